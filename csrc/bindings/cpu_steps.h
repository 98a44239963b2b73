// Step scalars and counters of the CPU step bindings (Adam, 8-bit Adam, SGD, Lion). They read their
// 1-element float32 scalars (shapes, dtypes and the CPU device checked by the op's check_*_args)
// and advance the step counters through their data: item() and add_(1) are dispatcher calls, a
// few microseconds each per tensor, which cost more than the update of a small tensor.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace mpfused::bind {

inline float cpu_scalar(const at::Tensor& t) { return *t.data_ptr<float>(); }

// The unscale-and-clip multiplier of a CPU step, or nullopt when found_inf > 0 (skip the step).
inline std::optional<float> cpu_grad_mult(const std::optional<at::Tensor>& grad_scale,
                                          const std::optional<at::Tensor>& found_inf,
                                          const std::optional<at::Tensor>& norm_sq,
                                          double max_grad_norm) {
  if (found_inf && cpu_scalar(*found_inf) > 0.f) return std::nullopt;
  float grad_mult = grad_scale ? 1.f / cpu_scalar(*grad_scale) : 1.f;
  if (norm_sq && max_grad_norm > 0) {
    const double norm = std::sqrt(double(cpu_scalar(*norm_sq)));
    grad_mult *= float(std::min(1.0, max_grad_norm / (norm + 1e-6)));
  }
  return grad_mult;
}

// This step's count t = step + 1 of each packed tensor (index: positions in `steps`).
inline std::vector<double> cpu_next_steps(at::TensorList steps, const std::vector<int64_t>& index) {
  std::vector<double> t(index.size());
  for (size_t j = 0; j < t.size(); ++j) t[j] = double(cpu_scalar(steps[index[j]])) + 1.0;
  return t;
}

// step += 1 for every counter (empty params included, as torch), as add_(1) would: in float32,
// with the version counter bumped.
inline void cpu_advance_steps(at::TensorList steps) {
  for (const at::Tensor& s : steps) {
    *s.data_ptr<float>() += 1.f;
    s.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace mpfused::bind
