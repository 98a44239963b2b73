// Times the CPU Adam kernel of one ISA clone on one thread (4 Mi elements, best of 15): built by
// run.sh with parallel.h narrowed to that clone, so an AVX2 or baseline clone can be timed on an
// AVX-512 machine. Argument: 0 = fp32 params, 2 = bf16 params + int16 remainder.
#include "cpu/adam_cpu.h"
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstring>
using namespace mpfused; using namespace mpfused::cpu;
int main(int argc, char** argv){
  const int64_t n = 1<<22; int dt = argc>1 ? atoi(argv[1]) : 0;  // 0 fp32, 2 bf16 remainder
  std::vector<float> p(n,0.5f), g(n,0.01f), m(n,0.f), v(n,0.f); std::vector<int16_t> rem(n,0);
  std::vector<uint16_t> pb(n, 0x3f00);
  void* P[1]={dt? (void*)pb.data():(void*)p.data()}; void* G[1]={dt?(void*)pb.data():(void*)g.data()}; void* M[1]={m.data()}; void* V[1]={v.data()}; void* X[1]={nullptr}; void* R[1]={rem.data()};
  int64_t numel[1]={n}; int32_t dtype[1]={dt? (int32_t)kBFloat16 : (int32_t)kFloat32};
  TensorLists<6> t{{P,G,M,V,X,R}, numel, dtype, 1};
  uint64_t streams[1]={0};
  AdamConfig c{1e-3,0.9,0.999,1e-8f,0.01,1.f,false,false,true, dt?2:0, 0, streams};
  double step=1; double best=1e9;
  for(int r=0;r<15;r++){auto a=std::chrono::steady_clock::now(); adam_step(t,&step,c,1); auto b=std::chrono::steady_clock::now(); double ns=std::chrono::duration<double,std::nano>(b-a).count()/n; if(ns<best)best=ns;}
  printf("%.2f ns/elem  (w0=%g)\n", best, (double)p[0]);
}
