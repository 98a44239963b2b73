// SGD (momentum, dampening, Nesterov, L2 weight decay) per-element math shared by every native
// backend: torch.optim.SGD's update, in torch's order, in fp32.
#pragma once
#include "mpfused/platform.h"

namespace mpfused {

// Scalars of one tensor's update. Constants torch derives from its double hyperparameters are
// derived here in double and rounded to fp32 once (1 - dampening), as torch's for-loop does when it
// hands them to add_(alpha=...).
struct SgdScalars {
  float lr;
  float weight_decay;         // L2 term: g += weight_decay * w (torch.optim.SGD's only decay)
  float momentum;
  float one_minus_dampening;  // 1 - dampening in double, rounded once
  float grad_mult;            // inv_scale * clip_coef, negated for maximize
  float first;  // 1 when t == 1 (the buffer starts as the gradient itself: torch clones it), else 0
};

MPF_HD SgdScalars sgd_scalars(double lr, double momentum, double dampening, double weight_decay,
                              bool maximize, float grad_mult, double t) {
  SgdScalars s;
  s.lr = float(lr);
  s.weight_decay = float(weight_decay);
  s.momentum = float(momentum);
  s.one_minus_dampening = float(1.0 - dampening);
  s.grad_mult = maximize ? -grad_mult : grad_mult;
  s.first = t <= 1.0 ? 1.f : 0.f;
  return s;
}

// One SGD update of the fp32 value w (buf: the momentum buffer, unused without MOMENTUM).
// torch: g = -g if maximize; g += wd * w; buf = g on the first step, else
// buf = momentum * buf + (1 - dampening) * g; g = g + momentum * buf (Nesterov) or buf; w -= lr * g.
template <bool MOMENTUM, bool NESTEROV>
MPF_HD void sgd_element(float& w, float g, float& buf, const SgdScalars& s) {
  // Both sides of each per-tensor choice are computed and one is selected on a float compare: GCC
  // vectorizes that on every ISA, not a branch around float math nor a select on a bool.
  g = g * s.grad_mult;
  const float decayed = g + s.weight_decay * w;
  g = s.weight_decay != 0.f ? decayed : g;  // wd == 0 leaves g as it is (an inf w stays out of g)
  if (MOMENTUM) {
    const float next = s.momentum * buf + s.one_minus_dampening * g;
    buf = s.first != 0.f ? g : next;
    g = NESTEROV ? g + s.momentum * buf : buf;
  }
  w = w - s.lr * g;
}

}  // namespace mpfused
