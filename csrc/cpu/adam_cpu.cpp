// CPU multi-tensor Adam/AdamW step: adam_math.h's element on the elementwise engine
// (elementwise_cpu.h). AMSGrad is a variant with a third state operand, max_exp_avg_sq.
#include "adam_cpu.h"

#include "elementwise_cpu.h"

namespace mpfused::cpu {
namespace {

// State operands exp_avg, exp_avg_sq (, max_exp_avg_sq): AdamOperand's kExpAvg.. in order, the
// engine's slots 2.., so the op's 6-operand layout is the engine's as it is.
template <bool AMSGRAD>
struct AdamPolicy {
  using Config = AdamConfig;
  using Scalars = AdamScalars;
  static constexpr int K = AMSGRAD ? 3 : 2;

  static Scalars scalars(const Config& c, double t) {
    return adam_scalars(c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.decoupled, c.maximize,
                        c.grad_mult, t);
  }
  static void element(float& w, float g, float* state, const Scalars& s) {
    float vmax = 0.f;  // read and written only with AMSGRAD
    if constexpr (AMSGRAD) vmax = state[2];
    adam_element<AMSGRAD>(w, g, state[0], state[1], vmax, s);
    if constexpr (AMSGRAD) state[2] = vmax;
  }
};

static_assert(kExpAvg == 2 && kExpAvgSq == 3 && kMaxExpAvgSq == 4 && kMaster == 5,
              "AdamOperand must be the engine's layout: param, grad, states, master last");

}  // namespace

void adam_step(const TensorLists<6>& t, const double* step, const AdamConfig& c, int num_threads) {
  if (c.amsgrad) elementwise_step<AdamPolicy<true>>(t, step, c, num_threads);
  else elementwise_step<AdamPolicy<false>>(t, step, c, num_threads);
}

}  // namespace mpfused::cpu
