#include "lion_cpu.h"

#include "elementwise_cpu.h"

namespace mpfused::cpu {
namespace {

struct LionPolicy {
  using Config = LionConfig;
  using Scalars = LionScalars;
  static constexpr int K = 1;  // exp_avg

  static Scalars scalars(const Config& c, double) {
    return lion_scalars(c.lr, c.beta1, c.beta2, c.weight_decay, c.maximize, c.grad_mult);
  }
  static void element(float& w, float g, float* state, const Scalars& s) {
    lion_element(w, g, state[0], s);
  }
};

}  // namespace

void lion_step(const TensorLists<4>& t, const double* step, const LionConfig& c, int num_threads) {
  elementwise_step<LionPolicy>(t, step, c, num_threads);
}

}  // namespace mpfused::cpu
