// CUDA multi-tensor Adam/AdamW step with block-wise 8-bit or 4-bit moments (raw pointers +
// cudaStream_t, no torch). Same semantics and per-element math as cpu::adam8bit_step, but
// everything a capturable optimizer needs is read on the device: step counters, lr (optionally),
// grad_scale, found_inf, norm_sq and the two quantization maps. No host sync anywhere.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operand order of the tensor lists handed to adam8bit_step: cpu::Adam8bitOperand plus the step
// counter. The first five have the param's numel (the numel of the list; 4-bit codes: ceil(numel
// / 2) bytes, two codes each); the two absmax operands hold ceil(numel / block_size) floats.
enum Adam8bitOperand {
  kQ8Param = 0,
  kQ8Grad = 1,
  kQ8ExpAvg = 2,    // uint8 codes (4-bit: packed), signed map
  kQ8ExpAvgSq = 3,  // uint8 codes (4-bit: packed), unsigned map
  kQ8Master = 4,    // fp32 master (kFp32Master) or int16 remainder (kRemainder); else unused
  kQ8Absmax1 = 5,   // fp32 per block, exp_avg
  kQ8Absmax2 = 6,   // fp32 per block, exp_avg_sq
  kQ8Step = 7,      // float* to the tensor's 0-dim float32 step counter (read only)
  kQ8Stream = 8,    // not a pointer: the tensor's sr_stream, by value (as adam_cuda.h's kStream)
};
constexpr int kAdam8bitDepth = 9;

struct Adam8bitConfig {
  double lr;             // used when lr_ptr is null
  const float* lr_ptr;   // null or a device float
  double beta1, beta2;   // unrounded: adam_scalars derives its constants in double (as torch)
  float eps;
  double weight_decay;
  const float* grad_scale;  // null or device float: grads are multiplied by 1 / *grad_scale
  const float* found_inf;   // null or device float: > 0 skips the step (nothing is written)
  const float* norm_sq;     // null or device float: sum of squares of the unscaled grads
  double max_grad_norm;     // clip when > 0 and norm_sq is given
  bool maximize, decoupled;
  int32_t master_mode;  // MasterMode, narrowed per dtype (effective_master_mode) as on the CPU
  uint64_t seed;        // stochastic rounding stream
  int64_t block_size;   // quantization block: a power of two in [64, 4096]
  const float* map1;    // device: signed map, 256 strictly increasing floats holding +0 above [0]
  const float* map2;    // device: unsigned map, 256 strictly increasing floats
  // 8: the above; 4: 16-entry maps (strictly increasing, no +0 needed: nearest code, no sign
  // rule), two codes per byte (quant8_math.h's "4-bit codes"), as cpu::Adam8bitConfig.
  int32_t code_bits = 8;
};

// Every operand is contiguous (logical order: the codes and absmax follow it). Operand kQ8Step:
// tensor i's step counter s, read as t = s + 1; the counters are incremented afterwards by
// cuda::increment_steps (step_counters_cuda.h), which skips on found_inf > 0 as this kernel does.
//
// The maps are read on the device, so they cannot be validated by the caller without a sync.
// They are checked on the device (sorted; 8-bit: +0 above the first entry); when they are not, every
// block writes NaN into the absmax of its quantization blocks and nothing else: a bad map
// surfaces as NaN moments at the next step instead of silently corrupting them. Memory safety
// never depends on the maps.
//
// workspace: device memory of adam8bit_workspace_bytes(t.size) bytes, 16-byte aligned, that
// nothing else uses until this call's launches are done (stream-ordered: the binding allocates it
// through torch's caching allocator, which also serves CUDA-graph capture). A first launch writes
// this step's thresholds and per-tensor scalars into it (adam8bit_prepare.cuh); the main kernel's
// blocks read them. Its content before and after the call means nothing.
//
// Returns cudaErrorInvalidValue for a block_size outside [64, 4096] or not a power of two, a
// code_bits other than 8 and 4, or a null or misaligned workspace (nothing runs), else the first
// launch error.
cudaError_t adam8bit_step(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                          void* workspace, cudaStream_t stream);

// Bytes of the workspace adam8bit_step needs for a list of `ntensors` tensors (2 KB + 48 each).
size_t adam8bit_workspace_bytes(int64_t ntensors);

}  // namespace mpfused::cuda
