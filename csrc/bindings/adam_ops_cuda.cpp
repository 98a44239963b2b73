// CUDA registration of the multi-tensor Adam/AdamW step. Same checks as the CPU binding; the
// kernel reads the step counters, grad_scale, found_inf, norm_sq and (optionally) lr on the
// device, and the counters advance by a second launch unless found_inf > 0: no host sync on any
// path (capturable).
#include "../cuda/adam_cuda.h"
#include "common.h"
#include "cuda_elementwise.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList masters, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                    int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed,
                    at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev =
      check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps,
                      amsgrad, master_mode, grad_scale, found_inf, norm_sq);
  // The moments in cuda::AdamOperand order; without amsgrad max_exp_avg_sq is absent (never
  // read) and the kernel launches without it.
  run_elementwise_cuda<3>(
      dev, params, grads, {exp_avgs, exp_avg_sqs, amsgrad ? max_exp_avg_sqs : at::TensorList()},
      masters, steps, lr, lr_tensor, maximize, master_mode, grad_scale, found_inf, norm_sq,
      max_grad_norm, seed, param_ids, elem_offsets,
      [&](const TensorLists<cuda::kAdamDepth>& t, const cuda::StepCommon& common,
          cudaStream_t stream) {
        const cuda::AdamConfig cfg{common, beta1, beta2, float(eps), weight_decay, amsgrad,
                                   decoupled};
        return cuda::adam_step(t, cfg, stream);
      });
}

}  // namespace

static_assert(std::is_same_v<decltype(adam_step_cuda), AdamStepFn>,
              "adam_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }

}  // namespace mpfused::bind
