// CUDA multi-tensor steps with one block-wise 8-bit state (raw pointers + cudaStream_t, no
// torch): SGD with an 8-bit momentum buffer and Lion with an 8-bit moment, in bitsandbytes'
// SGD8bit / Lion8bit layout; with State8bitCommon::code_bits = 4 the same steps on 4-bit codes
// (sgd4bit_step_ / lion4bit_step_: torchao's 4-bit format of AdamW4bit's first moment, 16-entry
// signed map, two codes per byte, no sign rule). Same semantics and per-element math as
// cpu::sgd8bit_step / cpu::lion8bit_step (one_state8bit_cpu.h), but everything a capturable
// optimizer needs is read on the device: step counters, lr (optionally), grad_scale, found_inf,
// norm_sq and the map. No host sync anywhere.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include "elementwise_step.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Operand order of the tensor lists: cpu::OneState8bitOperand plus the step counter and stream.
// The first four have the param's numel (the numel of the list; 4-bit codes: ceil(numel / 2)
// bytes); the absmax operand holds ceil(numel / block_size) floats.
enum OneState8bitOperand {
  kS8Param = 0,
  kS8Grad = 1,
  kS8State = 2,   // uint8 codes into the signed map (4-bit: two per byte, element 2k high)
  kS8Master = 3,  // masters of the mode (MasterStore: fp32, int16 or int8); else unused
  kS8Absmax = 4,  // fp32 per block
  kS8Step = 5,    // float* to the tensor's 0-dim float32 step counter (read only)
  kS8Stream = 6,  // not a pointer: the tensor's sr_stream, by value (as elementwise_step.h's)
};
constexpr int kOneState8bitDepth = 7;

// What both steps take besides their hyperparameters. common.master_mode is dispatched per
// dtype as cpu::pick_state8_kernel.
struct State8bitCommon {
  StepCommon common;   // lr, device scalars (grad_scale, found_inf, norm_sq), modes, seed
  int64_t block_size;  // quantization block: a power of two in [64, 4096]
  // device: signed map, 2^code_bits strictly increasing floats (8-bit: holding +0 above [0])
  const float* map;
  int32_t code_bits = 8;  // 8: one code per byte; 4: two (codes of ceil(numel / 2) bytes)
};

struct Sgd8bitConfig {
  State8bitCommon q;
  double momentum, dampening, weight_decay;  // momentum > 0 (the binding checks)
  bool nesterov;
};

struct Lion8bitConfig {
  State8bitCommon q;
  double beta1, beta2, weight_decay;
};

// Every operand is contiguous (logical order: the codes and absmax follow it). Operand kS8Step:
// tensor i's step counter s, read as t = s + 1 (SGD: t == 1 starts the buffer as the gradient;
// Lion: the seed only); the counters are incremented afterwards by cuda::increment_steps
// (step_counters_cuda.h), which skips on found_inf > 0 as these kernels do.
//
// The map is checked on the device (sorted; 8-bit: +0 above the first entry); when it is not,
// every block writes NaN into the absmax of its quantization blocks and nothing else, as
// cuda::adam8bit_step does. Memory safety never depends on the map.
//
// workspace: device memory of *_workspace_bytes(t.size) bytes, 16-byte aligned, unused by
// anything else until this call's launches are done (stream-ordered; the binding allocates it
// through torch's caching allocator). A first launch writes this step's thresholds and
// per-tensor scalars into it (quant8_prepare.cuh); its content before and after means nothing.
//
// Returns cudaErrorInvalidValue for a block_size outside [64, 4096] or not a power of two, a
// code_bits other than 8 and 4, or a null or misaligned workspace (nothing runs), else the first
// launch error.
cudaError_t sgd8bit_step(const TensorLists<kOneState8bitDepth>& t, const Sgd8bitConfig& cfg,
                         void* workspace, cudaStream_t stream);
cudaError_t lion8bit_step(const TensorLists<kOneState8bitDepth>& t, const Lion8bitConfig& cfg,
                          void* workspace, cudaStream_t stream);

// Bytes of the workspace for a list of `ntensors` tensors (1 KB + 32 or 40 each; either width).
size_t sgd8bit_workspace_bytes(int64_t ntensors);
size_t lion8bit_workspace_bytes(int64_t ntensors);

}  // namespace mpfused::cuda
