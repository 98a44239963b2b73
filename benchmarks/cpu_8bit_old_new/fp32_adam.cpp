// The fp32-state Adam step (adam_cpu) on the same params: the floor of the 8-bit steps.
#include "adam_cpu.h"
using namespace mpfused; using namespace mpfused::cpu;
extern "C" void step_f32(int mode, int dt, int64_t n, void* p, void* g, void* m, void* v, void* mst, double step) {
  void* P[1]={p}; void* G[1]={g}; void* M[1]={m}; void* V[1]={v}; void* X[1]={nullptr}; void* R[1]={mst};
  int64_t numel[1]={n}; int32_t dtype[1]={dt ? (int32_t)kBFloat16 : (int32_t)kFloat32};
  TensorLists<6> t{{P,G,M,V,X,R}, numel, dtype, 1};
  uint64_t streams[1]={0};
  AdamConfig c{1e-3,0.9,0.999,1e-8f,0.01,1.f,false,false,true, mode, 0, streams};
  adam_step(t,&step,c,1);
}
