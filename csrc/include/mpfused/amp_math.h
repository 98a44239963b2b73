// Loss-scaling math shared by every native backend: the per-element non-finite check and unscale,
// and the dynamic loss-scale update rule (torch._amp_update_scale_ semantics, plus opt-in
// hysteresis / min / max as in Megatron and DeepSpeed).
#pragma once
#include "mpfused/platform.h"

namespace mpfused {

// Unscale one gradient element; `bad` is OR-ed, never cleared. The test is on the unscaled fp32
// value: a non-finite g stays non-finite, and a scale that collapsed to a subnormal (inv_scale
// overflowing to inf) is caught too, where torch's check of the stored value lets NaN through.
MPF_HD float unscale_element(float g, float inv_scale, uint32_t& bad) {
  const float u = g * inv_scale;
  bad |= uint32_t(!is_finite_f32(u));
  return u;
}

struct ScaleUpdateParams {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis;  // 1 = off (torch): back off on every overflow
  float min_scale;     // 0 = off
  float max_scale;     // +inf = off
  // false (Megatron; DeepSpeed's default): the hysteresis budget refills only when the scale
  // grows. true (DeepSpeed's consecutive_hysteresis): every step without overflow refills it.
  bool consecutive_hysteresis = false;
};

// One update of (scale, growth_tracker, hysteresis_tracker) given this iteration's found_inf.
// Hysteresis N: an overflow spends one unit of a budget of N and the scale backs off when the
// budget is spent (and on every overflow after that until it refills); see
// consecutive_hysteresis for when it refills.
// With hysteresis == 1, min_scale == 0 and max_scale == inf this is bit-for-bit
// torch._amp_update_scale_: growth on the growth_interval-th consecutive clean update, refused
// when the grown scale would not be finite. `found_inf > 0` is the skip rule everywhere.
MPF_HD void update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                         float found_inf, const ScaleUpdateParams& p) {
  if (found_inf > 0.f) {
    *growth_tracker = 0;
    int32_t h = *hysteresis_tracker - 1;
    if (p.hysteresis <= 1 || h <= 0) {
      float s = float(double(*scale) * p.backoff_factor);
      *scale = p.min_scale > 0.f ? max_f32(s, p.min_scale) : s;
      h = h < 0 ? 0 : h;
    }
    *hysteresis_tracker = p.hysteresis <= 1 ? p.hysteresis : h;
  } else {
    if (p.consecutive_hysteresis) *hysteresis_tracker = p.hysteresis;
    const int64_t next = int64_t(*growth_tracker) + 1;
    if (next == p.growth_interval) {  // == as torch: a tracker past the interval never grows
      const float grown = float(double(*scale) * p.growth_factor);
      if (is_finite_f32(grown)) *scale = min_f32(grown, p.max_scale);
      *growth_tracker = 0;
      *hysteresis_tracker = p.hysteresis;  // refilled on growth (Megatron, DeepSpeed)
    } else {
      *growth_tracker = int32_t(next);
    }
  }
}

}  // namespace mpfused
