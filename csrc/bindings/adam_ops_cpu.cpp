// CPU registration of the multi-tensor Adam/AdamW step.
#include <ATen/Parallel.h>

#include "../cpu/adam_cpu.h"
#include "common.h"
#include "cpu_steps.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                   at::TensorList masters, at::TensorList steps, double lr,
                   const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                   double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                   int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed,
                   at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, amsgrad,
                  master_mode, grad_scale, found_inf, norm_sq);
  // Skip on found_inf > 0: nothing is touched, step counters included. CPU tensors: no sync.
  const std::optional<float> grad_mult = cpu_grad_mult(grad_scale, found_inf, norm_sq, max_grad_norm);
  if (!grad_mult) return;
  const bool has_master = mode_has_masters(master_mode);
  PackedLists<6> packed({params, grads, exp_avgs, exp_avg_sqs,
                         amsgrad ? max_exp_avg_sqs : at::TensorList(),
                         has_master ? masters : at::TensorList()},
                        {true, false, true, true, true, true}, "params",
                        /*require_logical_order=*/master_mode == kStochastic);  // the SR stream
                                                  // is indexed in logical (row-major) order
  const std::vector<double> t = cpu_next_steps(steps, packed.index);
  const std::vector<uint64_t> streams =
      sr_streams(param_ids, elem_offsets, params.size(), packed.index);
  cpu::AdamConfig cfg{host_lr(lr, lr_tensor), beta1, beta2, float(eps), weight_decay,
                      *grad_mult, amsgrad, maximize, decoupled, int32_t(master_mode),
                      uint64_t(seed), streams.data()};
  cpu::adam_step(packed.view(), t.data(), cfg, at::get_num_threads());
  packed.finish();
  cpu_advance_steps(steps);
}

}  // namespace

static_assert(std::is_same_v<decltype(adam_step_cpu), AdamStepFn>,
              "adam_step_cpu must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CPU, m) { m.impl("adam_step_", &adam_step_cpu); }

}  // namespace mpfused::bind
