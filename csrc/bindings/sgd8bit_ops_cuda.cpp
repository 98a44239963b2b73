// CUDA registration of the multi-tensor SGD step with a block-wise 8-bit momentum buffer. Same
// checks as the CPU binding (quant8_args.h), except the map's values, which the kernel checks on
// the device; every scalar is read on the device: no host sync (capturable).
#include "../cuda/one_state8bit_cuda.h"
#include "common.h"
#include "one_state8bit_cuda_run.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

void sgd8bit_step_cuda(at::TensorList params, at::TensorList grads,
                       at::TensorList momentum_buffers, at::TensorList absmaxs,
                       at::TensorList masters, at::TensorList steps, const at::Tensor& qmap,
                       int64_t block_size, double lr, const std::optional<at::Tensor>& lr_tensor,
                       double momentum, double dampening, double weight_decay, bool nesterov,
                       bool maximize, int64_t master_mode,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                       int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev = check_quant8_args(
      params, grads, {{momentum_buffers, absmaxs, "momentum_buffers (8-bit codes)", "absmaxs"}},
      masters, steps, block_size, master_mode, grad_scale, found_inf, norm_sq);
  // the 8-bit state is the buffer: plain SGD has none (bitsandbytes' SGD8bit refuses it too)
  TORCH_CHECK(momentum > 0, "mpfused: sgd8bit_step_: momentum must be > 0, got ", momentum);
  check_qmap(qmap, "qmap (signed map)", dev);
  run_one_state8bit_cuda(
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

static_assert(std::is_same_v<decltype(sgd8bit_step_cuda), Sgd8bitStepFn>,
              "sgd8bit_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("sgd8bit_step_", &sgd8bit_step_cuda); }

}  // namespace mpfused::bind
