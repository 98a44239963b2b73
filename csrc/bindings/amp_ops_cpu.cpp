// CPU registrations of the loss-scaling ops (schemas are defined once, in mpfused/ops/).
#include <ATen/Parallel.h>

#include "../cpu/amp_cpu.h"
#include "common.h"
#include "cpu_steps.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void amp_check_impl(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                    const std::optional<at::Tensor>& norm_sq,
                    const std::optional<at::Tensor>& norm_sq_per_tensor, bool write_back) {
  if (grads.empty()) return;
  check_amp_args(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor);
  PackedLists<1> packed({grads}, {write_back}, "grads");
  std::vector<float> per(packed.numel.size(), 0.f);
  // (inv_scale: a 1-element float32 CPU tensor, checked above; item() is a dispatcher call)
  cpu::amp_check(packed.view(), cpu_scalar(inv_scale), write_back, found_inf.data_ptr<float>(),
                 norm_sq ? norm_sq->data_ptr<float>() : nullptr,
                 norm_sq_per_tensor ? per.data() : nullptr, at::get_num_threads());
  if (norm_sq_per_tensor) {
    float* out = norm_sq_per_tensor->data_ptr<float>();
    for (size_t j = 0; j < per.size(); ++j) out[packed.index[j]] += per[j];
  }
  packed.finish();
}

void unscale_grads_cpu(at::TensorList grads, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, const std::optional<at::Tensor>& norm_sq,
                       const std::optional<at::Tensor>& norm_sq_per_tensor) {
  amp_check_impl(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, true);
}

void check_grads_cpu(at::TensorList grads, const at::Tensor& found_inf,
                     const at::Tensor& inv_scale, const std::optional<at::Tensor>& norm_sq,
                     const std::optional<at::Tensor>& norm_sq_per_tensor) {
  amp_check_impl(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, false);
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval,
                      int64_t hysteresis, double min_scale, double max_scale,
                      bool consecutive_hysteresis) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf);
  update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
               hysteresis_tracker.data_ptr<int32_t>(), cpu_scalar(found_inf),
               ScaleUpdateParams{growth_factor, backoff_factor, growth_interval,
                                 int32_t(hysteresis), float(min_scale), float(max_scale),
                                 consecutive_hysteresis});
}

}  // namespace

static_assert(std::is_same_v<decltype(check_grads_cpu), CheckGradsFn>,
              "check_grads: the signature BoundLists calls (op_signatures.h)");

TORCH_LIBRARY_IMPL(mpfused, CPU, m) {
  m.impl("unscale_grads_", &unscale_grads_cpu);
  m.impl("check_grads", &check_grads_cpu);
  m.impl("update_scale_", &update_scale_cpu);
}

}  // namespace mpfused::bind
