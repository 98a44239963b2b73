// CUDA multi-tensor Adam/AdamW step (raw pointers + cudaStream_t, no torch). Same semantics as
// cpu::adam_step, but everything a capturable optimizer needs is read on the device: step
// counters, lr (optionally), grad_scale, found_inf and norm_sq. No host sync anywhere.
#pragma once
#include <cuda_runtime.h>

#include "elementwise_step.h"
#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operands: elementwise_step.h's, then the fp32 moments. max_exp_avg_sq comes last so that
// non-AMSGrad launches carry one operand less (more tensors per launch); it may be null then.
enum AdamOperand {
  kAdamExpAvg = kEwState,
  kAdamExpAvgSq = kEwState + 1,
  kAdamMaxExpAvgSq = kEwState + 2,
};
constexpr int kAdamDepth = kEwFixed + 3;

struct AdamConfig {
  StepCommon common;
  double beta1, beta2;  // unrounded: adam_scalars derives its constants in double (as torch)
  float eps;
  double weight_decay;
  bool amsgrad, decoupled;
};

// params (dtype[i]: fp32/fp16/bf16) and grads of the same dtype; exp_avg, exp_avg_sq,
// max_exp_avg_sq (when amsgrad) fp32; master fp32 (kFp32Master) or int16 (kRemainder); operand
// kEwStep: tensor i's step counter s, read as t = s + 1 (the counters are incremented afterwards
// by increment_steps, step_counters_cuda.h). grad_mult = (1 / grad_scale) * min(1, max_grad_norm
// / (sqrt(norm_sq) + 1e-6)) and the bias corrections are computed per block on the device.
cudaError_t adam_step(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg, cudaStream_t stream);

}  // namespace mpfused::cuda
