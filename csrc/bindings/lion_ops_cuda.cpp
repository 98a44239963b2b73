// CUDA registration of the multi-tensor Lion step. Same checks as the CPU binding; the kernel
// reads the step counters, grad_scale, found_inf, norm_sq and (optionally) lr on the device, and
// the counters advance by a second launch unless found_inf > 0: no host sync (capturable).
#include "../cuda/lion_cuda.h"
#include "common.h"
#include "cuda_elementwise.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void lion_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList masters, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double weight_decay, bool maximize, int64_t master_mode,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed,
                    at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev = check_lion_args(params, grads, exp_avgs, masters, steps, master_mode,
                                         grad_scale, found_inf, norm_sq);
  run_elementwise_cuda<1>(
      dev, params, grads, {exp_avgs}, masters, steps, lr, lr_tensor, maximize, master_mode,
      grad_scale, found_inf, norm_sq, max_grad_norm, seed, param_ids, elem_offsets,
      [&](const TensorLists<cuda::kLionDepth>& t, const cuda::StepCommon& common,
          cudaStream_t stream) {
        const cuda::LionConfig cfg{common, beta1, beta2, weight_decay};
        return cuda::lion_step(t, cfg, stream);
      });
}

}  // namespace

static_assert(std::is_same_v<decltype(lion_step_cuda), LionStepFn>,
              "lion_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("lion_step_", &lion_step_cuda); }

}  // namespace mpfused::bind
