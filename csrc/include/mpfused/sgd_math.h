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
  bool first;                 // t == 1: the buffer starts as the gradient itself (torch clones it)
};

MPF_HD SgdScalars sgd_scalars(double lr, double momentum, double dampening, double weight_decay,
                              bool maximize, float grad_mult, double t) {
  SgdScalars s;
  s.lr = float(lr);
  s.weight_decay = float(weight_decay);
  s.momentum = float(momentum);
  s.one_minus_dampening = float(1.0 - dampening);
  s.grad_mult = maximize ? -grad_mult : grad_mult;
  s.first = t <= 1.0;
  return s;
}

// One SGD update of the fp32 value w (buf: the momentum buffer, unused without MOMENTUM).
// torch: g = -g if maximize; g += wd * w; buf = g on the first step, else
// buf = momentum * buf + (1 - dampening) * g; g = g + momentum * buf (Nesterov) or buf; w -= lr * g.
template <bool MOMENTUM, bool NESTEROV>
MPF_HD void sgd_element(float& w, float g, float& buf, const SgdScalars& s) {
  g = g * s.grad_mult;
  if (s.weight_decay != 0.f) g = g + s.weight_decay * w;
  if (MOMENTUM) {
    buf = s.first ? g : s.momentum * buf + s.one_minus_dampening * g;
    g = NESTEROV ? g + s.momentum * buf : buf;
  }
  w = w - s.lr * g;
}

}  // namespace mpfused
