// CPU multi-tensor Adam/AdamW step with block-wise 8-bit moments (raw pointers, no torch).
#pragma once
#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Operand order of the tensor lists handed to adam8bit_step. The first five have the param's
// numel (4-bit codes: ceil(numel / 2) bytes); the two absmax operands hold
// ceil(numel / block_size) floats.
enum Adam8bitOperand {
  kQParam = 0,
  kQGrad = 1,
  kQExpAvg = 2,    // uint8 codes, signed map
  kQExpAvgSq = 3,  // uint8 codes, unsigned map
  kQMaster = 4,    // fp32 master (kFp32Master) or int16 remainder (kRemainder); else unused
  kQAbsmax1 = 5,   // fp32 per block, exp_avg
  kQAbsmax2 = 6,   // fp32 per block, exp_avg_sq
};

struct Adam8bitConfig {
  double lr, beta1, beta2;  // unrounded: adam_scalars derives its constants in double
  float eps;
  double weight_decay;
  float grad_mult;  // inv_scale * clip coefficient
  bool maximize, decoupled;
  int32_t master_mode;  // MasterMode
  uint64_t seed;        // stochastic rounding stream
  const uint64_t* streams;  // streams[i]: tensor i's sr_stream (stochastic rounding)
  int64_t block_size;   // a power of two in [64, 4096]
  const float* map1;    // signed map, 256 sorted floats, +0 at zero_code1
  const float* map2;    // unsigned map, 256 sorted floats
  int32_t zero_code1;    // -1: no sign rule (4-bit)
  int32_t code_bits = 8;  // 8: 256-entry maps, a code per byte; 4: 16-entry maps, two per byte
};

// Every tensor is contiguous (logical order). step[i] is the step number t (already
// incremented) of tensor i. Bitwise deterministic for any thread count.
void adam8bit_step(const TensorLists<7>& t, const double* step, const Adam8bitConfig& cfg,
                   int num_threads);

}  // namespace mpfused::cpu
