// CUDA registration of the multi-tensor Lion steps with a block-wise 8-bit (lion8bit_step_) or
// 4-bit (lion4bit_step_: same schema, 16-entry map, packed codes, no sign rule; the same kernel
// specialized on the code width, as on the CPU) moment. Same checks as the CPU binding
// (quant8_args.h), except the map's values, which the kernel checks on the device; every scalar
// is read on the device: no host sync (capturable).
#include "../cuda/one_state8bit_cuda.h"
#include "common.h"
#include "one_state8bit_cuda_run.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

// BITS = 8: lion8bit_step_; 4: lion4bit_step_ (same schema).
template <int BITS>
void lion_quant_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList absmaxs, at::TensorList masters, at::TensorList steps,
                          const at::Tensor& qmap, int64_t block_size, double lr,
                          const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                          double weight_decay, bool maximize, int64_t master_mode,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf,
                          const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                          int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const char* codes_name = BITS == 8 ? "exp_avgs (8-bit codes)" : "exp_avgs (4-bit codes)";
  const at::Device dev = check_quant8_args(
      params, grads, {{exp_avgs, absmaxs, codes_name, "absmaxs"}}, masters, steps, block_size,
      master_mode, grad_scale, found_inf, norm_sq, BITS);
  check_qmap(qmap, "qmap (signed map)", dev, int64_t(1) << BITS);
  run_one_state8bit_cuda<BITS>(
      dev, params, grads, exp_avgs, absmaxs, masters, steps, qmap, block_size, lr, lr_tensor,
      maximize, master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, seed, param_ids,
      elem_offsets,
      [&](const TensorLists<cuda::kOneState8bitDepth>& t, const cuda::State8bitCommon& q,
          auto&& workspace, cudaStream_t stream) {
        const at::Tensor ws = workspace(cuda::lion8bit_workspace_bytes(t.size));
        const cuda::Lion8bitConfig cfg{q, beta1, beta2, weight_decay};
        return cuda::lion8bit_step(t, cfg, ws.data_ptr(), stream);
      });
}

}  // namespace

static_assert(std::is_same_v<decltype(lion_quant_step_cuda<8>), Lion8bitStepFn>,
              "lion_quant_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) {
  m.impl("lion8bit_step_", &lion_quant_step_cuda<8>);
  m.impl("lion4bit_step_", &lion_quant_step_cuda<4>);  // the same schema (4-bit codes)
}

}  // namespace mpfused::bind
