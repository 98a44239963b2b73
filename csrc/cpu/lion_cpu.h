// CPU multi-tensor Lion step (decoupled weight decay; raw pointers, no torch).
#pragma once
#include "mpfused/lion_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Operand order of the tensor lists handed to lion_step.
enum LionOperand { kLionParam = 0, kLionGrad = 1, kLionExpAvg = 2, kLionMaster = 3 };

struct LionConfig {
  double lr, beta1, beta2, weight_decay;  // unrounded: lion_scalars derives in double
  bool maximize;
  float grad_mult;          // inv_scale * clip coefficient
  int32_t master_mode;      // MasterMode
  uint64_t seed;            // stochastic rounding stream
  const uint64_t* streams;  // streams[i]: tensor i's sr_stream (stochastic rounding)
};

// params (dtype[i]: fp32/fp16/bf16) and grads of the same dtype; exp_avg fp32; master fp32
// (kFp32Master) or int16 (kRemainder). step[i] is tensor i's step t (already incremented): Lion
// has no bias correction, t only keys the stochastic-rounding draw.
void lion_step(const TensorLists<4>& t, const double* step, const LionConfig& cfg, int num_threads);

}  // namespace mpfused::cpu
