// CUDA multi-tensor Lion step (raw pointers + cudaStream_t, no torch): lion_math.h's update with
// the master modes, in-kernel unscale and clipping, skip on found_inf > 0, every scalar read on the
// device (step counters, lr optionally, grad_scale, found_inf, norm_sq): no host sync, capturable.
// Same results as the CPU kernel, bit for bit.
#pragma once
#include <cuda_runtime.h>

#include "elementwise_step.h"
#include "mpfused/lion_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operands: elementwise_step.h's, then the fp32 moment exp_avg.
constexpr int kLionExpAvg = kEwState;
constexpr int kLionDepth = kEwFixed + 1;

struct LionConfig {
  StepCommon common;
  double beta1, beta2, weight_decay;  // unrounded: lion_scalars derives 1 - beta, 1 - lr * wd
};

// The step counter (t = step + 1) only seeds stochastic rounding: Lion has no bias correction.
// The counters are advanced afterwards by increment_steps (step_counters_cuda.h).
cudaError_t lion_step(const TensorLists<kLionDepth>& t, const LionConfig& cfg, cudaStream_t stream);

}  // namespace mpfused::cuda
