// Driver of run.sh (see there): old vs new 8-bit/4-bit Adam CPU kernels, bit for bit and timed.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cmath>
#include <time.h>
static double tcpu(){ timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec*1e3+t.tv_nsec*1e-6; }
extern "C" void step_old(int,int,int,int64_t,void*,void*,void*,void*,void*,void*,void*,const float*,const float*,int,double,int);
extern "C" void step_new(int,int,int,int64_t,void*,void*,void*,void*,void*,void*,void*,const float*,const float*,int,double,int);
extern "C" void step1_old(int,int,int,int,int64_t,void*,void*,void*,void*,void*,const float*,int,double,int);
extern "C" void step1_new(int,int,int,int,int64_t,void*,void*,void*,void*,void*,const float*,int,double,int);
extern "C" void step_f32(int,int,int64_t,void*,void*,void*,void*,void*,double);
typedef void(*Fn1)(int,int,int,int,int64_t,void*,void*,void*,void*,void*,const float*,int,double,int);
typedef void(*Fn)(int,int,int,int64_t,void*,void*,void*,void*,void*,void*,void*,const float*,const float*,int,double,int);
static std::vector<float> rd(const char* f, int n){ std::vector<float> v(n); FILE* fp=fopen(f,"rb"); fread(v.data(),4,n,fp); fclose(fp); return v;}
struct St { std::vector<uint8_t> p, g, c1, c2, m; std::vector<float> a1, a2; };
static uint16_t bf(float x){ uint32_t u; memcpy(&u,&x,4); return uint16_t((u + 0x7fff + ((u>>16)&1))>>16); }
St make(int bits,int mode,int dt,int64_t n, bool special){
  St s; std::mt19937 r(1); std::normal_distribution<float> N(0,1);
  int es = dt?2:4; s.p.resize(n*es); s.g.resize(n*es);
  for(int64_t i=0;i<n;i++){ float w=N(r)*0.02f, gg=N(r)*1e-3f;
    if(special){ int k=i%997; if(k==3) gg=NAN; if(k==5) gg=INFINITY; if(k==7) gg=0; if(k==11) gg=1e-42f; if(k==13) w=-0.f; if(k==17) gg=-1e30f; if(k==19) w=NAN; if (k==23) gg = -0.f;}
    if(dt){ uint16_t a=bf(w), b=bf(gg); memcpy(&s.p[2*i],&a,2); memcpy(&s.g[2*i],&b,2);} else { memcpy(&s.p[4*i],&w,4); memcpy(&s.g[4*i],&gg,4);} }
  int64_t cb = bits==8? n : (n+1)/2; s.c1.assign(cb, 0); s.c2.assign(cb,0);
  if(bits==8) std::fill(s.c1.begin(), s.c1.end(), 127); else std::fill(s.c1.begin(), s.c1.end(), 0x77);
  int ms = mode==2?2:mode==4?1:mode==1?4:0; s.m.assign(std::max<int64_t>(n*ms,1),0);
  for(auto& x: s.m) x = r()&0xff;
  int blk = bits==4?128:256; int64_t nb=(n+blk-1)/blk; s.a1.assign(nb,0); s.a2.assign(nb,0);
  return s;
}
int main(int argc,char**argv){
  auto s8=rd(MAPS_DIR "/s8.bin",256), u8=rd(MAPS_DIR "/u8.bin",256), s4=rd(MAPS_DIR "/s4.bin",16), u4=rd(MAPS_DIR "/u4.bin",16);
  int64_t n = argc>1? (int64_t)atof(argv[1]) : 1000000; int reps = argc>2? atoi(argv[2]):21;
  const char* only = argc>3 ? argv[3] : "";
  struct Cfg{int bits,mode,dt; const char* name;} cfgs[]={{8,0,0,"8bit fp32"},{8,2,1,"8bit bf16+rem"},{8,4,1,"8bit bf16+rem8"},{4,0,0,"4bit fp32"},{4,2,1,"4bit bf16+rem"},{4,4,1,"4bit bf16+rem8"},{8,3,1,"8bit bf16+sr"},{4,0,1,"4bit bf16"},{8,1,1,"8bit bf16+fp32m"},{4,1,1,"4bit bf16+fp32m"},{4,3,1,"4bit bf16+sr"}};
  int bad=0;
  for(auto& c: cfgs){
    if(*only && !strstr(c.name, only)) continue;
    const float* m1 = c.bits==8? s8.data():s4.data(); const float* m2 = c.bits==8?u8.data():u4.data(); int zc = c.bits==8?127:-1;
    // correctness: several odd sizes, special values, compare old/new bitwise
    for(int64_t nn : {(int64_t)1, (int64_t)37, (int64_t)255, (int64_t)1000, (int64_t)4097, (int64_t)70001}){
      for(int sp=0;sp<2;sp++){
        St A=make(c.bits,c.mode,c.dt,nn,sp), B=A;
        for(int t=1;t<=4;t++){
          step_old(c.bits,c.mode,c.dt,nn,A.p.data(),A.g.data(),A.c1.data(),A.c2.data(),A.m.data(),A.a1.data(),A.a2.data(),m1,m2,zc,t,1);
          step_new(c.bits,c.mode,c.dt,nn,B.p.data(),B.g.data(),B.c1.data(),B.c2.data(),B.m.data(),B.a1.data(),B.a2.data(),m1,m2,zc,t,1);
        }
        bool ok = A.p==B.p && A.c1==B.c1 && A.c2==B.c2 && A.m==B.m && memcmp(A.a1.data(),B.a1.data(),A.a1.size()*4)==0 && memcmp(A.a2.data(),B.a2.data(),A.a2.size()*4)==0;
        if(!ok){ printf("MISMATCH %s n=%ld special=%d p%d c1%d c2%d m%d\n", c.name, nn, sp, A.p==B.p, A.c1==B.c1, A.c2==B.c2, A.m==B.m); bad++; }
      }
    }
    if(reps==0) continue;
    St A=make(c.bits,c.mode,c.dt,n,false), B=A;
    Fn f[2]={step_old,step_new}; St* S[2]={&A,&B}; std::vector<double> tm[2];
    for(int r=0;r<reps+3;r++) for(int k0=0;k0<2;k0++){ int k = (r&1)? 1-k0 : k0; St& s=*S[k];
      double a=tcpu();
      f[k](c.bits,c.mode,c.dt,n,s.p.data(),s.g.data(),s.c1.data(),s.c2.data(),s.m.data(),s.a1.data(),s.a2.data(),m1,m2,zc,r+1,1);
      double b=tcpu(); if(r>=3) tm[k].push_back(b-a); }
    { std::vector<float> m(n,0.f), v(n,0.f), mm(n,0.f); std::vector<double> tf;
      for(int r=0;r<reps+3;r++){ double a=tcpu(); step_f32(c.mode==4?2:c.mode,c.dt,n,A.p.data(),A.g.data(),m.data(),v.data(),mm.data(),r+1); double b=tcpu(); if(r>=3) tf.push_back(b-a);} 
      std::sort(tf.begin(),tf.end()); printf("  [fp32-state Adam, same params/mode(rem8->rem): median %.3f min %.3f]\n", tf[tf.size()/2], tf[0]); }
    for(int k=0;k<2;k++) std::sort(tm[k].begin(),tm[k].end());
    double o=tm[0][tm[0].size()/2], w=tm[1][tm[1].size()/2];
    printf("%-16s n=%ld cpu-ms median old %.3f new %.3f (new/old %.3f)  min old %.3f new %.3f (%.3f)\n", c.name, n, o, w, w/o, tm[0][0], tm[1][0], tm[1][0]/tm[0][0]);
  }
  // the one-state ops (SGD with momentum, Lion): the same checks and timing, no fp32 floor
  struct Cfg1{int alg,bits,mode,dt; const char* name;} cfgs1[]={
    {0,8,0,0,"sgd 8bit fp32"},{1,8,0,0,"lion 8bit fp32"},{0,4,0,0,"sgd 4bit fp32"},{1,4,0,0,"lion 4bit fp32"},
    {1,4,0,1,"lion 4bit bf16"},{1,4,2,1,"lion 4bit bf16+rem"},{1,4,4,1,"lion 4bit bf16+rem8"},
    {0,4,4,1,"sgd 4bit bf16+rem8"},{1,4,1,1,"lion 4bit bf16+fp32m"},{1,4,3,1,"lion 4bit bf16+sr"},{1,8,4,1,"lion 8bit bf16+rem8"}};
  for(auto& c: cfgs1){
    if(*only && !strstr(c.name, only)) continue;
    const float* m1 = c.bits==8? s8.data():s4.data(); int zc = c.bits==8?127:-1;
    for(int64_t nn : {(int64_t)1, (int64_t)37, (int64_t)255, (int64_t)1000, (int64_t)4097, (int64_t)70001}){
      for(int sp=0;sp<2;sp++){
        St A=make(c.bits,c.mode,c.dt,nn,sp), B=A;
        for(int t=1;t<=4;t++){
          step1_old(c.alg,c.bits,c.mode,c.dt,nn,A.p.data(),A.g.data(),A.c1.data(),A.m.data(),A.a1.data(),m1,zc,t,1);
          step1_new(c.alg,c.bits,c.mode,c.dt,nn,B.p.data(),B.g.data(),B.c1.data(),B.m.data(),B.a1.data(),m1,zc,t,1);
        }
        bool ok = A.p==B.p && A.c1==B.c1 && A.m==B.m && memcmp(A.a1.data(),B.a1.data(),A.a1.size()*4)==0;
        if(!ok){ printf("MISMATCH %s n=%ld special=%d p%d c%d m%d\n", c.name, nn, sp, A.p==B.p, A.c1==B.c1, A.m==B.m); bad++; }
      }
    }
    if(reps==0) continue;
    St A=make(c.bits,c.mode,c.dt,n,false), B=A;
    Fn1 f[2]={step1_old,step1_new}; St* S[2]={&A,&B}; std::vector<double> tm[2];
    for(int r=0;r<reps+3;r++) for(int k0=0;k0<2;k0++){ int k = (r&1)? 1-k0 : k0; St& s=*S[k];
      double a=tcpu();
      f[k](c.alg,c.bits,c.mode,c.dt,n,s.p.data(),s.g.data(),s.c1.data(),s.m.data(),s.a1.data(),m1,zc,r+1,1);
      double b=tcpu(); if(r>=3) tm[k].push_back(b-a); }
    for(int k=0;k<2;k++) std::sort(tm[k].begin(),tm[k].end());
    double o=tm[0][tm[0].size()/2], w=tm[1][tm[1].size()/2];
    printf("%-20s n=%ld cpu-ms median old %.3f new %.3f (new/old %.3f)  min old %.3f new %.3f (%.3f)\n", c.name, n, o, w, w/o, tm[0][0], tm[1][0], tm[1][0]/tm[0][0]);
  }
  printf(bad? "BITWISE MISMATCHES: %d\n" : "all bitwise equal\n", bad);
}
