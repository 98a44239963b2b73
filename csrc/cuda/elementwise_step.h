// What every CUDA elementwise step (elementwise_cuda.cuh: Adam, SGD, Lion) takes besides its own
// hyperparameters: the operand order of its tensor lists and the device-read scalars. Torch-free
// and host-includable (the bindings fill these).
#pragma once
#include <stdint.h>

namespace mpfused::cuda {

// Operand k of tensor i is lists.data[k][i]. The algorithm's K fp32 state operands come last, so
// a variant with fewer states (SGD without momentum) passes a prefix of the same lists and its
// launches carry fewer pointers per tensor (more tensors per launch).
enum ElementwiseOperand {
  kEwParam = 0,   // fp32 / fp16 / bf16 (lists.dtype[i])
  kEwGrad = 1,    // the param's dtype
  kEwMaster = 2,  // fp32 (kFp32Master) or int16 remainder (kRemainder) of a 16-bit param; else null
  kEwStep = 3,    // float* to the 0-dim float32 step counter s (read as t = s + 1, never written)
  kEwStream = 4,  // not a pointer: the tensor's sr_stream (adam_math.h), by value in the metadata
  kEwState = 5,   // first of the K fp32 state operands
};
constexpr int kEwFixed = 5;

// Device scalars are null or point to one device float.
struct StepCommon {
  double lr;                // used when lr_ptr is null
  const float* lr_ptr;
  const float* grad_scale;  // grads are multiplied by 1 / *grad_scale
  const float* found_inf;   // > 0 skips the step: nothing is written
  const float* norm_sq;     // sum of squares of the unscaled grads
  double max_grad_norm;     // clip when > 0 and norm_sq is given
  bool maximize;
  int32_t master_mode;      // MasterMode, dispatched per dtype as cpu::pick_elementwise_chunk
  uint64_t seed;            // stochastic rounding
};

}  // namespace mpfused::cuda
