// CUDA multi-tensor SGD step: sgd_math.h's element on the generic elementwise kernel. Three
// variants: no momentum (no state operand), momentum, Nesterov momentum.
#include "sgd_cuda.h"

#include "elementwise_cuda.cuh"

namespace mpfused::cuda {
namespace {

template <bool MOMENTUM, bool NESTEROV>
struct SgdPolicy {
  using Config = SgdConfig;
  using Scalars = SgdScalars;
  static constexpr int kStates = MOMENTUM ? 1 : 0;
  static constexpr int ilp(int /*mode*/) { return 4; }

  __device__ __forceinline__ static Scalars scalars(const Config& c, double lr, float grad_mult,
                                                    double t) {
    return sgd_scalars(lr, c.momentum, c.dampening, c.weight_decay, c.common.maximize, grad_mult,
                       t);
  }
  __device__ __forceinline__ static void element(float& w, float g, float (&st)[1],
                                                 const Scalars& s) {
    sgd_element<MOMENTUM, NESTEROV>(w, g, st[0], s);
  }
};

}  // namespace

cudaError_t sgd_step(const TensorLists<kSgdDepth>& t, const SgdConfig& cfg, cudaStream_t stream) {
  if (t.size == 0) return cudaSuccess;
  if (cfg.momentum == 0.0)  // as the reference: no buffer, no Nesterov
    return ew::step<SgdPolicy<false, false>>(ew::first_operands<kEwFixed>(t), cfg, stream);
  if (cfg.nesterov) return ew::step<SgdPolicy<true, true>>(t, cfg, stream);
  return ew::step<SgdPolicy<true, false>>(t, cfg, stream);
}

}  // namespace mpfused::cuda
