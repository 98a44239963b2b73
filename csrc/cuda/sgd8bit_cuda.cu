// CUDA multi-tensor SGD step with an 8-bit or 4-bit momentum buffer (sgd8bit_step_, sgd4bit_step_:
// cfg.q.code_bits): sgd_math.h's element (momentum, dampening, Nesterov, L2 decay; t == 1 starts
// the buffer as the gradient) on the one-state kernel (one_state8bit_cuda.cuh).
#include "mpfused/sgd_math.h"
#include "one_state8bit_cuda.cuh"

namespace mpfused::cuda {
namespace {

template <bool NESTEROV>
struct Sgd8bitPolicy {
  using Config = Sgd8bitConfig;
  using Scalars = SgdScalars;

  __device__ __forceinline__ static Scalars scalars(const Config& c, double lr, float grad_mult,
                                                    double t) {
    return sgd_scalars(lr, c.momentum, c.dampening, c.weight_decay, c.q.common.maximize,
                       grad_mult, t);
  }
  __device__ __forceinline__ static void element(float& w, float g, float& buf, const Scalars& s) {
    sgd_element<true, NESTEROV>(w, g, buf, s);
  }
};

}  // namespace

cudaError_t sgd8bit_step(const TensorLists<kOneState8bitDepth>& t, const Sgd8bitConfig& cfg,
                         void* workspace, cudaStream_t stream) {
  if (cfg.nesterov) return q8::one_state8bit_step<Sgd8bitPolicy<true>>(t, cfg, workspace, stream);
  return q8::one_state8bit_step<Sgd8bitPolicy<false>>(t, cfg, workspace, stream);
}

// Nesterov or not, the same record (SgdScalars, seed).
size_t sgd8bit_workspace_bytes(int64_t ntensors) {
  return q8::one_state8bit_workspace_bytes<Sgd8bitPolicy<false>>(ntensors);
}

}  // namespace mpfused::cuda
