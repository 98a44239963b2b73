// CPU multi-tensor Adam/AdamW step (raw pointers, no torch).
#pragma once
#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Operand order of the tensor lists handed to adam_step.
enum AdamOperand { kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kMaxExpAvgSq = 4, kMaster = 5 };

struct AdamConfig {
  double lr, beta1, beta2;  // unrounded: adam_scalars derives its constants in double
  float eps;
  double weight_decay;
  float grad_mult;  // inv_scale * clip coefficient
  bool amsgrad, maximize, decoupled;
  int32_t master_mode;  // MasterMode
  uint64_t seed;        // stochastic rounding stream
  const uint64_t* streams;  // streams[i]: tensor i's sr_stream (stochastic rounding)
};

// params (dtype[i]: fp32/fp16/bf16) and grads of the same dtype; exp_avg, exp_avg_sq,
// max_exp_avg_sq (when amsgrad) fp32; master fp32 (kFp32Master) or int16 (kRemainder).
// step[i] is the step number t (already incremented) used for tensor i's bias correction.
void adam_step(const TensorLists<6>& t, const double* step, const AdamConfig& cfg, int num_threads);

}  // namespace mpfused::cpu
