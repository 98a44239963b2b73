// CUDA registration of the multi-tensor SGD step. Same checks as the CPU binding; the kernel reads
// the step counters, grad_scale, found_inf, norm_sq and (optionally) lr on the device, and the
// counters advance by a second launch unless found_inf > 0: no host sync (capturable).
#include "../cuda/sgd_cuda.h"
#include "common.h"
#include "cuda_elementwise.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList masters, at::TensorList steps, double lr,
                   const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize, int64_t master_mode,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed,
                   at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev = check_sgd_args(params, grads, momentum_buffers, masters, steps, momentum,
                                        master_mode, grad_scale, found_inf, norm_sq);
  // momentum == 0: no buffer operand (never read), the kernel launches without it.
  run_elementwise_cuda<1>(
      dev, params, grads, {momentum != 0 ? momentum_buffers : at::TensorList()}, masters, steps,
      lr, lr_tensor, maximize, master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, seed,
      param_ids, elem_offsets,
      [&](const TensorLists<cuda::kSgdDepth>& t, const cuda::StepCommon& common,
          cudaStream_t stream) {
        const cuda::SgdConfig cfg{common, momentum, dampening, weight_decay, nesterov};
        return cuda::sgd_step(t, cfg, stream);
      });
}

}  // namespace

static_assert(std::is_same_v<decltype(sgd_step_cuda), SgdStepFn>,
              "sgd_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("sgd_step_", &sgd_step_cuda); }

}  // namespace mpfused::bind
