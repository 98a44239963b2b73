// Per-tensor scalars of one CPU multi-tensor step, for every CPU step kernel that derives them
// per step (elementwise_cpu.h's engine: Adam, SGD, Lion; adam8bit_cpu.cpp). The derivation itself
// (in double, rounded to fp32 once) is the algorithm's *_scalars in csrc/include/mpfused/*_math.h,
// shared with CUDA, which derives per tensor on the device; this is the host-side loop around it.
#pragma once
#include <stdint.h>
#include <vector>

#include "mpfused/adam_math.h"  // step_seed

namespace mpfused::cpu {

template <typename Scalars>
struct StepScalars {
  std::vector<Scalars> scalars;
  std::vector<uint64_t> seeds;  // stochastic-rounding stream of each tensor's step
};

// scalars_of(t) for each tensor's step t = step[i] and step_seed(seed, t). Tensors of a group
// usually share their step: the scalars (pow() calls) are reused while it repeats, which matters
// with thousands of small tensors.
template <typename Scalars, typename F>
StepScalars<Scalars> step_scalars(const double* step, int64_t n, uint64_t seed, F&& scalars_of) {
  StepScalars<Scalars> out{std::vector<Scalars>(size_t(n)), std::vector<uint64_t>(size_t(n))};
  for (int64_t i = 0; i < n; ++i) {
    out.scalars[i] = i > 0 && step[i] == step[i - 1] ? out.scalars[i - 1] : scalars_of(step[i]);
    out.seeds[i] = step_seed(seed, step[i]);
  }
  return out;
}

}  // namespace mpfused::cpu
