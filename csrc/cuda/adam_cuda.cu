// CUDA multi-tensor Adam/AdamW step: adam_math.h's element on the generic elementwise kernel
// (elementwise_cuda.cuh). Two variants: Adam(W) (exp_avg, exp_avg_sq) and AMSGrad (+ its
// max_exp_avg_sq, a third state operand).
#include "adam_cuda.h"

#include "elementwise_cuda.cuh"

namespace mpfused::cuda {
namespace {

template <bool AMS>
struct AdamPolicy {
  using Config = AdamConfig;
  using Scalars = AdamScalars;
  static constexpr int kStates = AMS ? 3 : 2;
  // Elements in flight per thread in the scalar loop: AMSGrad (one more operand) keeps 3, and 2
  // with the int8 master correction (kRemainder8), its widest operand set: within 64 registers
  // without spilling (3 spilled 12 B there, ptxas 13.0, sm_80 and sm_90).
  static constexpr int ilp(int mode) { return !AMS ? 4 : mode == kRemainder8 ? 2 : 3; }

  __device__ __forceinline__ static Scalars scalars(const Config& c, double lr, float grad_mult,
                                                    double t) {
    return adam_scalars(lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.decoupled,
                        c.common.maximize, grad_mult, t);
  }
  __device__ __forceinline__ static void element(float& w, float g, float (&st)[kStates],
                                                 const Scalars& s) {
    float vmax = 0.f;  // read and written only with AMS
    if constexpr (AMS) vmax = st[2];
    adam_element<AMS>(w, g, st[0], st[1], vmax, s);
    if constexpr (AMS) st[2] = vmax;
  }
};

}  // namespace

cudaError_t adam_step(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg,
                      cudaStream_t stream) {
  if (t.size == 0) return cudaSuccess;
  if (cfg.amsgrad) return ew::step<AdamPolicy<true>>(t, cfg, stream);
  return ew::step<AdamPolicy<false>>(ew::first_operands<kEwFixed + 2>(t), cfg, stream);
}

}  // namespace mpfused::cuda
