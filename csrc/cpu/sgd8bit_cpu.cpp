// SGD with an 8-bit momentum buffer: sgd_element (torch.optim.SGD's momentum, dampening,
// Nesterov, L2 decay) inside the one-state 8-bit kernel.
#include "mpfused/sgd_math.h"
#include "one_state8bit_kernel.h"

namespace mpfused::cpu {
namespace {

template <bool NESTEROV>
struct SgdMomentum {
  SgdScalars s;
  __attribute__((always_inline)) void operator()(float& w, float g, float& buf) const {
    sgd_element<true, NESTEROV>(w, g, buf, s);
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
