// Per-tensor scalars of one CPU multi-tensor 8-bit Adam step (fp32-state Adam gets the same
// from the elementwise engine: elementwise_cpu.h's elementwise_step, with the same reuse rule).
#pragma once
#include <stdint.h>
#include <vector>

#include "mpfused/adam_math.h"

namespace mpfused::cpu {

struct StepScalars {
  std::vector<AdamScalars> scalars;
  std::vector<uint64_t> seeds;  // stochastic-rounding stream of each tensor's step
};

// `Config` has lr, beta1, beta2, eps, weight_decay, decoupled, maximize, grad_mult and seed.
// Tensors of a group usually share their step: the scalars (two pow() calls) are reused while it
// repeats, which matters with thousands of small tensors.
template <typename Config>
StepScalars step_scalars(const Config& c, const double* step, int64_t n) {
  StepScalars out{std::vector<AdamScalars>(size_t(n)), std::vector<uint64_t>(size_t(n))};
  for (int64_t i = 0; i < n; ++i) {
    out.scalars[i] = i > 0 && step[i] == step[i - 1]
                         ? out.scalars[i - 1]
                         : adam_scalars(c.lr, c.beta1, c.beta2, c.eps, c.weight_decay,
                                        c.decoupled, c.maximize, c.grad_mult, step[i]);
    out.seeds[i] = step_seed(c.seed, step[i]);
  }
  return out;
}

}  // namespace mpfused::cpu
