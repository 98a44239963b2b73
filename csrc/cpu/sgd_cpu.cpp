#include "sgd_cpu.h"

#include "elementwise_cpu.h"

namespace mpfused::cpu {
namespace {

// Without momentum there is no buffer (K = 0): the engine reads no state operand.
template <bool MOMENTUM, bool NESTEROV>
struct SgdPolicy {
  using Config = SgdConfig;
  using Scalars = SgdScalars;
  static constexpr int K = MOMENTUM ? 1 : 0;

  static Scalars scalars(const Config& c, double t) {
    return sgd_scalars(c.lr, c.momentum, c.dampening, c.weight_decay, c.maximize, c.grad_mult, t);
  }
  static void element(float& w, float g, float* state, const Scalars& s) {
    sgd_element<MOMENTUM, NESTEROV>(w, g, state[0], s);  // state[0] unread without MOMENTUM
  }
};

}  // namespace

void sgd_step(const TensorLists<4>& t, const double* step, const SgdConfig& c, int num_threads) {
  // momentum == 0 as the reference tests it (in double): Nesterov needs a buffer to act on
  if (c.momentum == 0) elementwise_step<SgdPolicy<false, false>>(t, step, c, num_threads);
  else if (c.nesterov) elementwise_step<SgdPolicy<true, true>>(t, step, c, num_threads);
  else elementwise_step<SgdPolicy<true, false>>(t, step, c, num_threads);
}

}  // namespace mpfused::cpu
