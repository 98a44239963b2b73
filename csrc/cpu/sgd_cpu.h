// CPU multi-tensor SGD step (momentum, dampening, Nesterov, L2 decay; raw pointers, no torch).
#pragma once
#include "mpfused/sgd_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Operand order of the tensor lists handed to sgd_step.
enum SgdOperand { kSgdParam = 0, kSgdGrad = 1, kSgdMomentumBuffer = 2, kSgdMaster = 3 };

struct SgdConfig {
  double lr, momentum, dampening, weight_decay;  // unrounded: sgd_scalars derives in double
  bool nesterov, maximize;
  float grad_mult;          // inv_scale * clip coefficient
  int32_t master_mode;      // MasterMode
  uint64_t seed;            // stochastic rounding stream
  const uint64_t* streams;  // streams[i]: tensor i's sr_stream (stochastic rounding)
};

// params (dtype[i]: fp32/fp16/bf16) and grads of the same dtype; momentum buffers fp32 (null when
// momentum == 0); master fp32 (kFp32Master) or int16 (kRemainder). step[i] is tensor i's step t
// (already incremented): t == 1 starts its buffer from the gradient.
void sgd_step(const TensorLists<4>& t, const double* step, const SgdConfig& cfg, int num_threads);

}  // namespace mpfused::cpu
