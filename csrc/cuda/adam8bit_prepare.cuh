// The prepare launch of the 8-bit / 4-bit Adam kernel (adam8bit_cuda.cu), on quant8_prepare.cuh:
// both maps' Eytzinger thresholds (4-bit: padded with +inf), the map checks and the +0 code of
// map 1 (8-bit), and each tensor's AdamScalars (the fp64 pow of the bias corrections) and seed,
// once per call into the caller's workspace. BITS: the code width (8: 256-entry maps, 4: 16).
#pragma once
#include <stddef.h>

#include "adam8bit_cuda.h"
#include "quant8_prepare.cuh"

namespace mpfused::cuda {
namespace q8 {

struct alignas(16) PreparedTensor {
  AdamScalars s;
  float pad;
  uint64_t seed;  // step_seed(cfg.seed, t)
};
static_assert(sizeof(PreparedTensor) == 48, "workspace layout: every byte a member");

template <int BITS>
struct AdamPrepare {
  static constexpr int kMaps = 2;
  static constexpr int kCodes = 1 << BITS;
  using Config = Adam8bitConfig;
  using Tensor = PreparedTensor;

  __device__ __forceinline__ static bool skipped(const Config& cfg) {
    return cfg.found_inf != nullptr && *cfg.found_inf > 0.f;
  }
  __device__ __forceinline__ static const float* map(const Config& cfg, int i) {
    return i == 0 ? cfg.map1 : cfg.map2;
  }
  // One tensor's scalars, exactly as the CPU binding forms them (grad_mult) and the elementwise
  // Adam kernel (elementwise_cuda.cuh with adam_cuda.cu's policy).
  __device__ __forceinline__ static Tensor tensor(const Config& cfg, const float* step) {
    const float grad_mult = prepared_grad_mult(cfg.grad_scale, cfg.norm_sq, cfg.max_grad_norm);
    const double t = double(*step) + 1.0;
    const double lr = cfg.lr_ptr != nullptr ? double(*cfg.lr_ptr) : cfg.lr;
    Tensor out;
    out.s = adam_scalars(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.decoupled,
                         cfg.maximize, grad_mult, t);
    out.pad = 0.f;
    out.seed = step_seed(cfg.seed, t);
    return out;
  }
};

using Workspace = PreparedWorkspace<2, PreparedTensor>;  // both widths: the same layout

inline size_t workspace_bytes(int64_t ntensors) { return Workspace::bytes(ntensors); }

template <int BITS>
cudaError_t prepare(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                    void* workspace, cudaStream_t stream) {
  return q8::prepare<AdamPrepare<BITS>>(t, kQ8Step, cfg, workspace, stream);
}

}  // namespace q8
}  // namespace mpfused::cuda
