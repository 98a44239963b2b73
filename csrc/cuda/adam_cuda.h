// CUDA multi-tensor Adam/AdamW step (raw pointers + cudaStream_t, no torch). Same semantics as
// cpu::adam_step, but everything a capturable optimizer needs is read on the device: step
// counters, lr (optionally), grad_scale, found_inf and norm_sq. No host sync anywhere.
#pragma once
#include <cuda_runtime.h>

#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operand order of the tensor lists handed to adam_step: cpu::AdamOperand plus the step counter.
enum AdamOperand {
  kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kMaxExpAvgSq = 4, kMaster = 5,
  kStep = 6,  // float* to the tensor's 0-dim float32 step counter (read only, not indexed)
  kStream = 7,  // not a pointer: the tensor's sr_stream (adam_math.h), carried by value in the
                // launch metadata like the operands (no device table: capturable)
};
constexpr int kAdamDepth = 8;

struct AdamConfig {
  double lr;             // used when lr_ptr is null
  const float* lr_ptr;   // null or a device float
  double beta1, beta2;   // unrounded: adam_scalars derives its constants in double (as torch)
  float eps;
  double weight_decay;
  const float* grad_scale;  // null or device float: grads are multiplied by 1 / *grad_scale
  const float* found_inf;   // null or device float: > 0 skips the step (nothing is written)
  const float* norm_sq;     // null or device float: sum of squares of the unscaled grads
  double max_grad_norm;     // clip when > 0 and norm_sq is given
  bool amsgrad, maximize, decoupled;
  int32_t master_mode;  // MasterMode, dispatched per dtype as cpu::pick_kernel
  uint64_t seed;        // stochastic rounding stream
};

// params (dtype[i]: fp32/fp16/bf16) and grads of the same dtype; exp_avg, exp_avg_sq,
// max_exp_avg_sq (when amsgrad) fp32; master fp32 (kFp32Master) or int16 (kRemainder); operand
// kStep: tensor i's step counter s, read as t = s + 1 (the counters are incremented afterwards by
// increment_steps, step_counters_cuda.h). grad_mult = (1 / grad_scale) * min(1, max_grad_norm /
// (sqrt(norm_sq) + 1e-6)) and the bias corrections are computed per block on the device.
cudaError_t adam_step(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg, cudaStream_t stream);

}  // namespace mpfused::cuda
