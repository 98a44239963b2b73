// One SGD / Lion step with a one-state 8-bit/4-bit buffer of one tensor (run.sh builds it once per
// revision, STEP1_FN named). alg 0: SGD (momentum 0.9, weight decay 0.01), 1: Lion.
#include "one_state8bit_cpu.h"
using namespace mpfused; using namespace mpfused::cpu;
extern "C" void STEP1_FN(int alg, int bits, int mode, int dt, int64_t n, void* p, void* g, void* c,
                         void* mst, void* a, const float* map, int zc, double step, int threads) {
  void* P[1]={p}; void* G[1]={g}; void* C[1]={c}; void* M[1]={mst}; void* A[1]={a};
  int64_t numel[1]={n}; int32_t dtype[1]={dt ? (int32_t)kBFloat16 : (int32_t)kFloat32};
  TensorLists<5> t{{P,G,C,M,A}, numel, dtype, 1};
  uint64_t streams[1]={12345};
  State8bitConfig q{alg ? 1e-4 : 1e-3, 0.01, 1.f, false, mode, 77, streams, bits==4?128:256, map,
                    zc, bits};
  if (alg == 0) sgd8bit_step(t, &step, Sgd8bitConfig{q, 0.9, 0.0, false}, threads);
  else lion8bit_step(t, &step, Lion8bitConfig{q, 0.9, 0.99}, threads);
}
