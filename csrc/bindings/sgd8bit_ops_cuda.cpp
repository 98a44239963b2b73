// CUDA registration of the multi-tensor SGD steps with a block-wise 8-bit (sgd8bit_step_) or 4-bit
// (sgd4bit_step_: same schema, 16-entry map, packed codes, no sign rule; the same kernel
// specialized on the code width, as on the CPU) momentum buffer. Same checks as the CPU binding
// (quant8_args.h), except the map's values, which the kernel checks on the device; every scalar
// is read on the device: no host sync (capturable).
#include "../cuda/one_state8bit_cuda.h"
#include "common.h"
#include "one_state8bit_cuda_run.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

// BITS = 8: sgd8bit_step_; 4: sgd4bit_step_ (same schema).
template <int BITS>
void sgd_quant_step_cuda(at::TensorList params, at::TensorList grads,
                         at::TensorList momentum_buffers, at::TensorList absmaxs,
                         at::TensorList masters, at::TensorList steps, const at::Tensor& qmap,
                         int64_t block_size, double lr,
                         const std::optional<at::Tensor>& lr_tensor, double momentum,
                         double dampening, double weight_decay, bool nesterov, bool maximize,
                         int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                         int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const char* codes_name =
      BITS == 8 ? "momentum_buffers (8-bit codes)" : "momentum_buffers (4-bit codes)";
  const at::Device dev = check_quant8_args(
      params, grads, {{momentum_buffers, absmaxs, codes_name, "absmaxs"}}, masters, steps,
      block_size, master_mode, grad_scale, found_inf, norm_sq, BITS);
  // the 8-bit state is the buffer: plain SGD has none (bitsandbytes' SGD8bit refuses it too)
  TORCH_CHECK(momentum > 0, "mpfused: ", BITS == 8 ? "sgd8bit_step_" : "sgd4bit_step_",
              ": momentum must be > 0, got ", momentum);
  check_qmap(qmap, "qmap (signed map)", dev, int64_t(1) << BITS);
  run_one_state8bit_cuda<BITS>(
      dev, params, grads, momentum_buffers, absmaxs, masters, steps, qmap, block_size, lr,
      lr_tensor, maximize, master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, seed,
      param_ids, elem_offsets,
      [&](const TensorLists<cuda::kOneState8bitDepth>& t, const cuda::State8bitCommon& q,
          auto&& workspace, cudaStream_t stream) {
        const at::Tensor ws = workspace(cuda::sgd8bit_workspace_bytes(t.size));
        const cuda::Sgd8bitConfig cfg{q, momentum, dampening, weight_decay, nesterov};
        return cuda::sgd8bit_step(t, cfg, ws.data_ptr(), stream);
      });
}

}  // namespace

static_assert(std::is_same_v<decltype(sgd_quant_step_cuda<8>), Sgd8bitStepFn>,
              "sgd_quant_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) {
  m.impl("sgd8bit_step_", &sgd_quant_step_cuda<8>);
  m.impl("sgd4bit_step_", &sgd_quant_step_cuda<4>);  // the same schema (4-bit codes)
}

}  // namespace mpfused::bind
