// Lion with an 8-bit moment: lion_element (decoupled decay, sign step, NaN kept) inside the
// one-state 8-bit kernel.
#include "mpfused/lion_math.h"
#include "one_state8bit_kernel.h"

namespace mpfused::cpu {
namespace {

struct LionUpdate {
  LionScalars s;
  __attribute__((always_inline)) void operator()(float& w, float g, float& m) const {
    lion_element(w, g, m, s);
  }
  template <class F>
  __attribute__((always_inline)) void visit(F&& f) const { f(*this); }  // one case
};

}  // namespace

void lion8bit_step(const TensorLists<5>& t, const double* step, const Lion8bitConfig& c,
                   int num_threads) {
  if (t.size == 0) return;
  const LionScalars s = lion_scalars(c.q.lr, c.beta1, c.beta2, c.q.weight_decay, c.q.maximize,
                                     c.q.grad_mult);
  state8bit_step(t, step, c.q, std::vector<LionUpdate>(size_t(t.size), LionUpdate{s}),
                 num_threads);
}

}  // namespace mpfused::cpu
