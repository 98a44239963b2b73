// CPU multi-tensor steps with one block-wise 8-bit state (raw pointers, no torch): SGD with an
// 8-bit momentum buffer and Lion with an 8-bit moment, in bitsandbytes' SGD8bit / Lion8bit layout;
// with State8bitConfig::code_bits = 4 the same steps on 4-bit codes (torchao's 4-bit format of
// AdamW4bit's first moment: 16-entry signed map, two codes per byte, no sign rule).
#pragma once
#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Operand order of the tensor lists handed to sgd8bit_step / lion8bit_step. The first four have
// the param's numel (4-bit codes: half of it, rounded up); the absmax operand holds
// ceil(numel / block_size) floats.
enum OneState8bitOperand {
  kSParam = 0,
  kSGrad = 1,
  kSState = 2,   // uint8 codes into the signed map (4-bit: ceil(numel / 2) bytes, packed)
  kSMaster = 3,  // fp32 master (kFp32Master) or int16 remainder (kRemainder); else unused
  kSAbsmax = 4,  // fp32 per block
};

// What every one-state 8-bit step takes besides its algorithm's hyperparameters.
struct State8bitConfig {
  double lr, weight_decay;  // unrounded: the scalars are derived in double
  float grad_mult;          // inv_scale * clip coefficient
  bool maximize;
  int32_t master_mode;      // MasterMode
  uint64_t seed;            // stochastic rounding stream
  const uint64_t* streams;  // streams[i]: tensor i's sr_stream (stochastic rounding)
  int64_t block_size;       // a power of two in [64, 4096]
  const float* map;         // signed map, 2^code_bits sorted floats, +0 at zero_code
  int32_t zero_code;        // 8-bit: the sign rule steps below it; -1: none (4-bit)
  int32_t code_bits = 8;    // 8: one code per byte; 4: two (codes of ceil(numel / 2) bytes)
};

struct Sgd8bitConfig {
  State8bitConfig q;
  double momentum, dampening;  // momentum > 0
  bool nesterov;
};

struct Lion8bitConfig {
  State8bitConfig q;
  double beta1, beta2;
};

// Every tensor is contiguous (logical order). step[i] is the step number t (already
// incremented) of tensor i. Bitwise deterministic for any thread count.
void sgd8bit_step(const TensorLists<5>& t, const double* step, const Sgd8bitConfig& cfg,
                  int num_threads);
void lion8bit_step(const TensorLists<5>& t, const double* step, const Lion8bitConfig& cfg,
                   int num_threads);

}  // namespace mpfused::cpu
