// CUDA multi-tensor SGD step (raw pointers + cudaStream_t, no torch): torch.optim.SGD's update
// (sgd_math.h) with the master modes, in-kernel unscale and clipping, skip on found_inf > 0, every
// scalar read on the device (step counters, lr optionally, grad_scale, found_inf, norm_sq): no host
// sync, capturable. Same results as the CPU kernel, bit for bit.
#pragma once
#include <cuda_runtime.h>

#include "elementwise_step.h"
#include "mpfused/sgd_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operands: elementwise_step.h's, then the fp32 momentum buffer (unused, may be null, when
// momentum == 0: those launches carry only the first kEwFixed operands).
constexpr int kSgdMomentum = kEwState;
constexpr int kSgdDepth = kEwFixed + 1;

struct SgdConfig {
  StepCommon common;
  double momentum, dampening, weight_decay;  // unrounded: sgd_scalars derives 1 - dampening
  bool nesterov;                             // ignored when momentum == 0
};

// t = step + 1 per tensor; t == 1 starts the buffer as the gradient (as torch). The counters are
// advanced afterwards by increment_steps (step_counters_cuda.h).
cudaError_t sgd_step(const TensorLists<kSgdDepth>& t, const SgdConfig& cfg, cudaStream_t stream);

}  // namespace mpfused::cuda
