// CUDA multi-tensor Lion step with an 8-bit or 4-bit moment (lion8bit_step_, lion4bit_step_:
// cfg.q.code_bits): lion_math.h's element (decoupled decay, sign step, NaN kept) on the one-state
// kernel (one_state8bit_cuda.cuh).
#include "mpfused/lion_math.h"
#include "one_state8bit_cuda.cuh"

namespace mpfused::cuda {
namespace {

struct Lion8bitPolicy {
  using Config = Lion8bitConfig;
  using Scalars = LionScalars;

  __device__ __forceinline__ static Scalars scalars(const Config& c, double lr, float grad_mult,
                                                    double /*t: no bias correction*/) {
    return lion_scalars(lr, c.beta1, c.beta2, c.weight_decay, c.q.common.maximize, grad_mult);
  }
  __device__ __forceinline__ static void element(float& w, float g, float& m, const Scalars& s) {
    lion_element(w, g, m, s);
  }
};

}  // namespace

cudaError_t lion8bit_step(const TensorLists<kOneState8bitDepth>& t, const Lion8bitConfig& cfg,
                          void* workspace, cudaStream_t stream) {
  return q8::one_state8bit_step<Lion8bitPolicy>(t, cfg, workspace, stream);
}

size_t lion8bit_workspace_bytes(int64_t ntensors) {
  return q8::one_state8bit_workspace_bytes<Lion8bitPolicy>(ntensors);
}

}  // namespace mpfused::cuda
