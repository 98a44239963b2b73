// One 8-bit/4-bit Adam step of one tensor (run.sh builds it once per revision, STEP_FN named).
#include "adam8bit_cpu.h"
using namespace mpfused; using namespace mpfused::cpu;
extern "C" void STEP_FN(int bits, int mode, int dt, int64_t n, void* p, void* g, void* c1, void* c2,
                        void* mst, void* a1, void* a2, const float* map1, const float* map2,
                        int zc, double step, int threads) {
  void* P[1]={p}; void* G[1]={g}; void* C1[1]={c1}; void* C2[1]={c2}; void* M[1]={mst};
  void* A1[1]={a1}; void* A2[1]={a2};
  int64_t numel[1]={n}; int32_t dtype[1]={dt ? (int32_t)kBFloat16 : (int32_t)kFloat32};
  TensorLists<7> t{{P,G,C1,C2,M,A1,A2}, numel, dtype, 1};
  uint64_t streams[1]={12345};
  Adam8bitConfig c{1e-3,0.9,0.999,1e-8f,0.01,1.f,false,true, mode, 77, streams, bits==4?128:256,
                   map1, map2, zc, bits};
  adam8bit_step(t,&step,c,threads);
}
