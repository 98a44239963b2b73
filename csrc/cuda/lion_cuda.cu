// CUDA multi-tensor Lion step: lion_math.h's element on the generic elementwise kernel.
#include "lion_cuda.h"

#include "elementwise_cuda.cuh"

namespace mpfused::cuda {
namespace {

struct LionPolicy {
  using Config = LionConfig;
  using Scalars = LionScalars;
  static constexpr int kStates = 1;
  static constexpr int ilp(int /*mode*/) { return 4; }

  __device__ __forceinline__ static Scalars scalars(const Config& c, double lr, float grad_mult,
                                                    double /*t: no bias correction*/) {
    return lion_scalars(lr, c.beta1, c.beta2, c.weight_decay, c.common.maximize, grad_mult);
  }
  __device__ __forceinline__ static void element(float& w, float g, float (&st)[1],
                                                 const Scalars& s) {
    lion_element(w, g, st[0], s);
  }
};

}  // namespace

cudaError_t lion_step(const TensorLists<kLionDepth>& t, const LionConfig& cfg,
                      cudaStream_t stream) {
  if (t.size == 0) return cudaSuccess;
  return ew::step<LionPolicy>(t, cfg, stream);
}

}  // namespace mpfused::cuda
