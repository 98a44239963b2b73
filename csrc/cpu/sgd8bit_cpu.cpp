// SGD with an 8-bit momentum buffer: sgd_element (torch.optim.SGD's momentum, dampening,
// Nesterov, L2 decay) inside the one-state 8-bit kernel.
#include "mpfused/sgd_math.h"
#include "one_state8bit_kernel.h"

namespace mpfused::cpu {
namespace {

template <bool NESTEROV>
struct SgdMomentum {
  SgdScalars s;

  // sgd_element with s.first and (s.weight_decay != 0) known at compile time: its branches on
  // them fold away, so the kernel's loop has no conditional arithmetic in any case.
  template <bool FIRST, bool DECAY>
  struct Case {
    SgdScalars s;
    __attribute__((always_inline)) void operator()(float& w, float g, float& buf) const {
      SgdScalars k = s;
      k.first = FIRST;
      if constexpr (!DECAY) k.weight_decay = 0.f;
      else if (k.weight_decay == 0.f) __builtin_unreachable();  // visit picked DECAY from it
      sgd_element<true, NESTEROV>(w, g, buf, k);
    }
  };

  template <class F>
  __attribute__((always_inline)) void visit(F&& f) const {
    const bool decay = s.weight_decay != 0.f;
    if (s.first) decay ? f(Case<true, true>{s}) : f(Case<true, false>{s});
    else decay ? f(Case<false, true>{s}) : f(Case<false, false>{s});
  }
};

template <bool NESTEROV>
void run(const TensorLists<5>& t, const double* step, const Sgd8bitConfig& c, int num_threads) {
  std::vector<SgdMomentum<NESTEROV>> upd(size_t(t.size));
  for (int64_t i = 0; i < t.size; ++i)  // per tensor: its first step starts the buffer
    upd[i].s = sgd_scalars(c.q.lr, c.momentum, c.dampening, c.q.weight_decay, c.q.maximize,
                           c.q.grad_mult, step[i]);
  state8bit_step(t, step, c.q, upd, num_threads);
}

}  // namespace

void sgd8bit_step(const TensorLists<5>& t, const double* step, const Sgd8bitConfig& c,
                  int num_threads) {
  if (t.size == 0) return;
  if (c.nesterov) run<true>(t, step, c, num_threads);
  else run<false>(t, step, c, num_threads);
}

}  // namespace mpfused::cpu
