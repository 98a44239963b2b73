// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") per-element math shared
// by every native backend, with decoupled weight decay, in the order of lion-pytorch and
// bitsandbytes' 32-bit Lion: decay w, step by the sign of the interpolation c, then update m.
#pragma once
#include "mpfused/platform.h"

namespace mpfused {

struct LionScalars {
  float lr;
  float decay_mult;  // 1 - lr * weight_decay in double, rounded once (lion-pytorch's mul_ factor)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;  // 1 - beta in double, rounded once
  float grad_mult;               // inv_scale * clip_coef, negated for maximize
};

MPF_HD LionScalars lion_scalars(double lr, double beta1, double beta2, double weight_decay,
                                bool maximize, float grad_mult) {
  LionScalars s;
  s.lr = float(lr);
  s.decay_mult = float(1.0 - lr * weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.grad_mult = maximize ? -grad_mult : grad_mult;
  return s;
}

// +1 / -1, a zero keeps itself (sign(0) = 0: an exactly balanced interpolation moves nothing, as
// torch.sign in lion-pytorch and bitsandbytes' sign), and NaN stays NaN. That last is a deliberate
// difference: torch.sign and bitsandbytes map NaN to 0, so a NaN gradient there makes a silent zero
// step and a NaN moment that freezes the param for good; here the NaN shows in the weights.
// On the bits, with integer compares only: a float compare of NaN may raise FP exceptions, so CPU
// compilers (-ftrapping-math, the default) do not vectorize a second compare that only runs when
// the first fails (AVX2 builds stayed scalar). Same results as
// x > 0 ? 1 : (x < 0 ? -1 : x) for every float.
MPF_HD float sign_f32(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t mag = u & 0x7FFFFFFFu;
  const bool keep = mag == 0u || mag > 0x7F800000u;  // +-0 and NaN are their own sign
  return bits_f32(keep ? u : (u & 0x80000000u) | 0x3F800000u);  // +-1 with x's sign
}

// One Lion update of the fp32 value w with its moment m:
// w *= 1 - lr*wd; c = b1*m + (1-b1)*g; w -= lr * sign(c); m = b2*m + (1-b2)*g.
MPF_HD void lion_element(float& w, float g, float& m, const LionScalars& s) {
  g = g * s.grad_mult;
  w = w * s.decay_mult;
  const float c = s.beta1 * m + s.one_minus_beta1 * g;
  w = w - s.lr * sign_f32(c);
  m = s.beta2 * m + s.one_minus_beta2 * g;
}

}  // namespace mpfused
