"""Standalone build checks of the CUDA backend that need no GPU, only nvcc on PATH:

* every csrc/cuda/*.cu compiles with `nvcc -c -std=c++17 -arch=sm_80` and `-arch=sm_90` (the
  kernels are torch-free, include path csrc/include only);
* the multi-tensor packing (mta_pack + mta_locate of multi_tensor_apply.cuh) is run on the host
  against an exhaustive check of which block runs which chunk, including tensors > 2^31 elements
  and launches that split a tensor;
* the 8-bit Adam kernel's block algorithm (csrc/cuda/adam8bit_cuda.cu, built with
  MPF_Q8_HOST_EMULATION) is run on the host, every CUDA block as 512 cooperative threads with real
  barrier and warp-shuffle semantics (a divergent barrier or a partial-warp shuffle is an error),
  and compared byte for byte (guard bytes included) with the CPU kernel cpu::adam8bit_step: every
  master mode and dtype, block sizes 64..4096, tails, misaligned (scalar-path) tensors, launches
  split mid-tensor, found_inf skips, bad maps;
* the CUDA bindings (csrc/bindings/*_cuda.cpp) pass `g++ -fsyntax-only` against torch's headers
  when the installed torch ships c10/cuda headers (a CPU wheel does, minus one generated header
  that is stubbed here) and a CUDA toolkit include dir is found.

All jobs run in parallel, once per module, under one deadline so the module stays < 2 minutes;
a job cut by that deadline (an overloaded machine) is skipped, not failed.
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
CU_FILES = sorted(glob.glob(str(ROOT / "csrc" / "cuda" / "*.cu")))
ARCHS = ["sm_80", "sm_90"]
BINDINGS = sorted(glob.glob(str(ROOT / "csrc" / "bindings" / "*_cuda.cpp")))
DEADLINE_S = 110.0

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")

PACK_TEST = r"""
// Host-only test of the multi-tensor packing (mta_pack + mta_locate): no GPU needed.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "multi_tensor_apply.cuh"

using namespace mpfused;
using namespace mpfused::cuda;

static long failures = 0;
#define EXPECT(cond)                                                           \
  do {                                                                         \
    if (!(cond) && ++failures < 20) std::printf("FAIL line %d: %s\n", __LINE__, #cond); \
  } while (0)

template <int DEPTH>
void check(const std::vector<int64_t>& numel, int64_t chunk, int64_t max_blocks) {
  const int64_t n = int64_t(numel.size());
  std::vector<int32_t> dtype(n);
  std::vector<std::vector<void*>> ptrs(DEPTH, std::vector<void*>(n));
  for (int64_t i = 0; i < n; ++i) {
    dtype[i] = int32_t(i % 3);
    for (int d = 0; d < DEPTH; ++d) ptrs[d][i] = reinterpret_cast<void*>(uintptr_t(16 * (i * 8 + d + 1)));
  }
  TensorLists<DEPTH> L;
  for (int d = 0; d < DEPTH; ++d) L.data[d] = ptrs[d].data();
  L.numel = numel.data();
  L.dtype = dtype.data();
  L.size = n;
  std::vector<std::pair<int64_t, int64_t>> seq;  // (tensor, chunk in tensor) in call order
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c * chunk < numel[t]; ++c) seq.push_back({t, c});
  int64_t g = 0;
  bool last_was_full = true;
  mta_pack(L, chunk, max_blocks, [&](const MtaMeta<DEPTH>& meta, int64_t nb) {
    EXPECT(last_was_full);  // only the final launch may be partly filled
    last_was_full = meta.ntensors == MtaMeta<DEPTH>::kMaxTensors || nb == max_blocks;
    EXPECT(nb >= 1 && nb <= max_blocks);
    EXPECT(meta.ntensors >= 1 && meta.ntensors <= MtaMeta<DEPTH>::kMaxTensors);
    for (int64_t b = 0; b < nb; ++b) {
      const MtaChunk<DEPTH> c = mta_locate<DEPTH>(meta, int32_t(b));
      EXPECT(g < int64_t(seq.size()));
      if (g >= int64_t(seq.size())) return;
      const int64_t t = seq[g].first, ci = seq[g].second;
      EXPECT(c.chunk == g);
      EXPECT(c.tensor == t);
      EXPECT(c.chunk_in_tensor == ci);
      EXPECT(c.begin == ci * chunk);
      EXPECT(c.numel == numel[t]);
      EXPECT(c.n == std::min(chunk, numel[t] - ci * chunk) && c.n > 0);
      EXPECT(c.dtype == dtype[t]);
      EXPECT(c.chunk_size == chunk);
      for (int d = 0; d < DEPTH; ++d) EXPECT(c.ptr[d] == ptrs[d][t]);
      ++g;
    }
  });
  EXPECT(g == int64_t(seq.size()));
}

template <int DEPTH>
void random_cases(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int rep = 0; rep < 200; ++rep) {
    const int64_t chunk = int64_t(1) << (rng() % 5);
    const int64_t max_blocks = rep % 3 == 0 ? kMaxBlocksPerLaunch : 1 + int64_t(rng() % 40);
    std::vector<int64_t> numel(rng() % 700);
    for (auto& x : numel) x = rng() % 10 == 0 ? 0 : int64_t(rng() % (5 * chunk + 3));
    check<DEPTH>(numel, chunk, max_blocks);
  }
}

int main() {
  random_cases<1>(1);
  random_cases<2>(2);
  random_cases<7>(3);
  const std::vector<int64_t> huge = {5, (int64_t(1) << 31) + 12345, 7, 3 * (int64_t(1) << 31) + 1};
  check<1>(huge, kChunkSize, kMaxBlocksPerLaunch);
  check<7>(huge, kChunkSize, 1000);
  check<2>(huge, int64_t(1) << 16, 3);
  std::printf("tensors per launch: depth1 %d depth2 %d depth7 %d\n", MtaMeta<1>::kMaxTensors,
              MtaMeta<2>::kMaxTensors, MtaMeta<7>::kMaxTensors);
  if (failures) {
    std::printf("%ld failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
"""


ADAM8BIT_EMULATION = r"""
// Host emulation of the CUDA 8-bit Adam kernel's block algorithm (q8::run_block in
// adam8bit_cuda.cu, compiled with MPF_Q8_HOST_EMULATION): every CUDA block of a multi-tensor call
// is run as 512 cooperative threads (ucontext) with real barrier and warp-shuffle semantics, and
// the results are compared byte for byte with the CPU kernel (cpu::adam8bit_step).
#define MPF_Q8_HOST_EMULATION 1
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "adam8bit_cuda.cu"
#include "../cpu/adam8bit_cpu.h"

using namespace mpfused;
using namespace mpfused::cuda;

static long failures = 0;
#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond) && ++failures < 30) {                                          \
      std::printf("FAIL line %d: %s: ", __LINE__, #cond);                      \
      std::printf(__VA_ARGS__);                                                \
      std::printf("\n");                                                       \
    }                                                                          \
  } while (0)

// ---- one CUDA block as kBlockSize cooperative threads -------------------------------------------
struct HostBlock;
static HostBlock* g_block = nullptr;

struct HostExec {
  HostBlock* b;
  int t;
  int tid() const { return t; }
  void sync() const;
  bool sync_and(bool p) const;
  uint32_t shfl_xor(uint32_t x, int off) const;
};

struct HostBlock {
  static constexpr int N = kBlockSize;
  static constexpr int kRun = -2, kBlockBarrier = -1;  // wait[t]: running, block barrier, warp w
  ucontext_t main_ctx;
  ucontext_t ctx[N];
  std::vector<char> stacks = std::vector<char>(size_t(N) * (1 << 16));
  int wait[N];
  bool done[N];
  uint32_t xchg[2][N];
  int parity[N];
  bool flags[N];
  int cur = 0;
  const char* error = nullptr;
  void (*body)(const HostExec&, void*) = nullptr;
  void* arg = nullptr;

  void barrier(int t, int kind) {
    wait[t] = kind;
    swapcontext(&ctx[t], &main_ctx);
  }
  static void entry() {
    HostBlock* b = g_block;
    const int t = b->cur;
    b->body(HostExec{b, t}, b->arg);
    b->done[t] = true;
  }
  // Runs body on all threads; false on a deadlock (divergent barrier / partial-warp shuffle).
  bool run(void (*fn)(const HostExec&, void*), void* a) {
    g_block = this;
    body = fn;
    arg = a;
    for (int t = 0; t < N; ++t) {
      wait[t] = kRun;
      done[t] = false;
      parity[t] = 0;
      getcontext(&ctx[t]);
      ctx[t].uc_stack.ss_sp = stacks.data() + size_t(t) * (1 << 16);
      ctx[t].uc_stack.ss_size = 1 << 16;
      ctx[t].uc_link = &main_ctx;
      makecontext(&ctx[t], &HostBlock::entry, 0);
    }
    for (;;) {
      for (int t = 0; t < N; ++t) {
        if (done[t] || wait[t] != kRun) continue;
        cur = t;
        swapcontext(&main_ctx, &ctx[t]);
      }
      int ndone = 0, nblock = 0;
      for (int t = 0; t < N; ++t) {
        ndone += done[t];
        nblock += !done[t] && wait[t] == kBlockBarrier;
      }
      if (ndone == N) return true;
      if (nblock == N) {  // every thread at the block barrier (none exited)
        for (int t = 0; t < N; ++t) wait[t] = kRun;
        continue;
      }
      if (nblock > 0 && ndone > 0) {
        error = "__syncthreads with exited threads";
        return false;
      }
      bool released = false;
      for (int w = 0; w < N / 32; ++w) {
        bool all = true;
        for (int l = 0; l < 32; ++l) all = all && !done[w * 32 + l] && wait[w * 32 + l] == w;
        if (all) {
          for (int l = 0; l < 32; ++l) wait[w * 32 + l] = kRun;
          released = true;
        }
      }
      if (!released) {
        error = "deadlock: divergent barrier or shuffle with inactive lanes";
        return false;
      }
    }
  }
};

void HostExec::sync() const { b->barrier(t, HostBlock::kBlockBarrier); }
bool HostExec::sync_and(bool p) const {
  b->flags[t] = p;
  b->barrier(t, HostBlock::kBlockBarrier);
  bool all = true;
  for (int i = 0; i < HostBlock::N; ++i) all = all && b->flags[i];
  b->barrier(t, HostBlock::kBlockBarrier);
  return all;
}
// One warp barrier per shuffle: consecutive shuffles of a thread alternate between two exchange
// buffers, and a lane can only reuse a buffer after the next barrier, i.e. once every lane of its
// warp has read it.
uint32_t HostExec::shfl_xor(uint32_t x, int off) const {
  const int buf = b->parity[t];
  b->parity[t] ^= 1;
  b->xchg[buf][t] = x;
  b->barrier(t, t / 32);
  return b->xchg[buf][(t & ~31) | ((t & 31) ^ off)];
}

// ---- test data --------------------------------------------------------------------------------
constexpr int kGuard = 64;  // canary bytes around every buffer
constexpr unsigned char kCanary = 0xA5;

struct Buf {
  std::vector<unsigned char> mem;
  size_t off = 0, bytes = 0;
  void init(size_t nbytes, size_t misalign) {
    bytes = nbytes;
    off = kGuard + misalign;
    mem.assign(nbytes + 2 * kGuard + 64, kCanary);
  }
  void* ptr() { return bytes ? mem.data() + off : nullptr; }
};

struct Tensor {
  int64_t n = 0;
  int dtype = kFloat32;
  Buf p, g, c1, c2, master, a1, a2, step;
};

static size_t elem_size(int dt) { return dt == kFloat32 ? 4 : 2; }

static void put(Buf& b, int dt, int64_t i, float x) {
  unsigned char* q = static_cast<unsigned char*>(b.ptr());
  if (dt == kFloat32) std::memcpy(q + 4 * i, &x, 4);
  else {
    const uint16_t h = dt == kFloat16 ? f16_bits_rne(x) : bf16_bits_rne(x);
    std::memcpy(q + 2 * i, &h, 2);
  }
}

struct Case {
  const char* name;
  std::vector<int64_t> sizes;
  int mode;
  int block;
  bool misalign = false;
  bool grad_scale = false, clip = false, lr_ptr = false, maximize = false, decoupled = true;
  bool has_found = false;
  float found = 0.f;
  int bad_map = 0;             // 1 unsorted, 2 no +0 (sorted), 3 +0 at index 0
  int64_t max_blocks = kMaxBlocksPerLaunch;
  bool zero_state = false;     // absmax 0 (first step)
};

struct Maps {
  float m1[256], m2[256];
};

static void run_case(const Case& k, const Maps& maps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unif(1e-4f, 1e-2f);
  const int B = k.block;
  std::vector<Tensor> ts(k.sizes.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    t.n = k.sizes[i];
    t.dtype = int(i % 3);
    const size_t es = elem_size(t.dtype);
    const size_t mis = k.misalign && (i % 2 == 1) ? 1 : 0;  // odd tensors: 1 element past aligned
    t.p.init(t.n * es, mis * es);
    t.g.init(t.n * es, mis * es);
    t.c1.init(t.n, mis);
    t.c2.init(t.n, mis);
    const int64_t nb = (t.n + B - 1) / B;
    t.a1.init(nb * 4, 0);
    t.a2.init(nb * 4, 0);
    t.step.init(4, 0);
    const bool fp32_master = k.mode == kFp32Master && t.dtype != kFloat32;
    const bool remainder = k.mode == kRemainder && t.dtype == kBFloat16;
    if (fp32_master) t.master.init(t.n * 4, mis * 4);
    if (remainder) t.master.init(t.n * 2, mis * 2);
    for (int64_t j = 0; j < t.n; ++j) {
      const float w = normal(rng) * 0.5f;
      put(t.p, t.dtype, j, w);
      // Every 7th element: m_old = 0 and a tiny gradient, so the new m rounds to the +0 code
      // (bitsandbytes' sign rule: a negative one is stored one code below).
      const bool tiny = j % 7 == 3;
      put(t.g, t.dtype, j, normal(rng) * (tiny ? 1e-6f : 1.f) * (k.grad_scale ? 1024.f : 1.f));
      static_cast<uint8_t*>(t.c1.ptr())[j] = uint8_t(k.zero_state || tiny ? 127 : byte(rng));
      static_cast<uint8_t*>(t.c2.ptr())[j] = uint8_t(k.zero_state ? 0 : byte(rng));
      if (fp32_master) {
        const float m = w + normal(rng) * 1e-4f;
        std::memcpy(static_cast<float*>(t.master.ptr()) + j, &m, 4);
      }
      if (remainder) static_cast<int16_t*>(t.master.ptr())[j] = int16_t(byte(rng) * 256 + byte(rng));
    }
    for (int64_t j = 0; j < nb; ++j) {
      static_cast<float*>(t.a1.ptr())[j] = k.zero_state ? 0.f : unif(rng) * 10.f;
      static_cast<float*>(t.a2.ptr())[j] = k.zero_state ? 0.f : unif(rng) * 1e-3f;
    }
    *static_cast<float*>(t.step.ptr()) = float((3 * i) % 7);
  }
  Maps mp = maps;
  if (k.bad_map == 1) std::swap(mp.m1[10], mp.m1[11]);
  if (k.bad_map == 2) mp.m1[127] = 0.5f * mp.m1[128];
  if (k.bad_map == 3) {
    for (int j = 0; j < 256; ++j) mp.m1[j] = mp.m2[j];
  }
  float grad_scale = 1024.f, found = k.found, lr = 1e-3f;
  float norm_sq = 0.f;
  for (auto& t : ts)
    for (int64_t j = 0; j < t.n; ++j) {
      const unsigned char* q = static_cast<unsigned char*>(t.g.ptr());
      float x;
      if (t.dtype == kFloat32) std::memcpy(&x, q + 4 * j, 4);
      else {
        uint16_t h;
        std::memcpy(&h, q + 2 * j, 2);
        x = t.dtype == kFloat16 ? to_f32(f16_t{h}) : to_f32(bf16_t{h});
      }
      x /= k.grad_scale ? grad_scale : 1.f;
      norm_sq += x * x;
    }
  const double max_grad_norm = k.clip ? 0.3 * std::sqrt(double(norm_sq)) : 0.0;

  // Packed lists (empty tensors dropped, as PackedLists does).
  std::vector<Tensor> ref = ts;  // the CPU kernel runs on a copy
  auto pack = [&](std::vector<Tensor>& v, int depth, std::vector<std::vector<void*>>& ptrs,
                  std::vector<int64_t>& numel, std::vector<int32_t>& dtype,
                  std::vector<double>& steps) {
    ptrs.assign(depth, {});
    for (auto& t : v) {
      if (t.n == 0) continue;
      Buf* ops[8] = {&t.p, &t.g, &t.c1, &t.c2, &t.master, &t.a1, &t.a2, &t.step};
      for (int d = 0; d < depth; ++d) ptrs[d].push_back(ops[d]->ptr());
      numel.push_back(t.n);
      dtype.push_back(t.dtype);
      steps.push_back(double(*static_cast<float*>(t.step.ptr())) + 1.0);
    }
  };
  std::vector<std::vector<void*>> gp, cp;
  std::vector<int64_t> gn, cn;
  std::vector<int32_t> gd, cd;
  std::vector<double> gs, cs;
  pack(ts, 8, gp, gn, gd, gs);
  pack(ref, 7, cp, cn, cd, cs);

  // Expected: the CPU kernel with the binding's host-side decisions.
  int zc = -1;
  bool sorted = true;
  for (int j = 0; j < 256; ++j) {
    if (mp.m1[j] == 0.f && !std::signbit(mp.m1[j])) zc = j;
    if (j + 1 < 256) sorted = sorted && mp.m1[j] < mp.m1[j + 1] && mp.m2[j] < mp.m2[j + 1];
  }
  const bool bad = !sorted || zc <= 0;
  const bool skip = k.has_found && k.found > 0.f;
  if (!bad && !skip && !cn.empty()) {
    float gm = k.grad_scale ? 1.f / grad_scale : 1.f;
    if (k.clip && max_grad_norm > 0)
      gm *= float(std::min(1.0, max_grad_norm / (std::sqrt(double(norm_sq)) + 1e-6)));
    TensorLists<7> L{};
    for (int d = 0; d < 7; ++d) L.data[d] = cp[d].data();
    L.numel = cn.data();
    L.dtype = cd.data();
    L.size = int64_t(cn.size());
    cpu::Adam8bitConfig c{lr, 0.9, 0.999, 1e-8f, 0.01f, gm, k.maximize, k.decoupled, k.mode,
                          1234, B, mp.m1, mp.m2, zc};
    cpu::adam8bit_step(L, cs.data(), c, 1);
  }
  if (bad && !skip)
    for (auto& t : ref)
      for (int64_t j = 0; j < (t.n + B - 1) / B; ++j) {
        static_cast<float*>(t.a1.ptr())[j] = NAN;
        static_cast<float*>(t.a2.ptr())[j] = NAN;
      }

  // The emulated CUDA call: multi_tensor_apply's packing, every block (in a scrambled order).
  if (!gn.empty()) {
    TensorLists<kAdam8bitDepth> L{};
    for (int d = 0; d < 8; ++d) L.data[d] = gp[d].data();
    L.numel = gn.data();
    L.dtype = gd.data();
    L.size = int64_t(gn.size());
    Adam8bitConfig cfg{};
    cfg.lr = k.lr_ptr ? 0.f : lr;
    cfg.lr_ptr = k.lr_ptr ? &lr : nullptr;
    cfg.beta1 = 0.9;
    cfg.beta2 = 0.999;
    cfg.eps = 1e-8f;
    cfg.weight_decay = 0.01f;
    cfg.grad_scale = k.grad_scale ? &grad_scale : nullptr;
    cfg.found_inf = k.has_found ? &found : nullptr;
    cfg.norm_sq = k.clip ? &norm_sq : nullptr;
    cfg.max_grad_norm = max_grad_norm;
    cfg.maximize = k.maximize;
    cfg.decoupled = k.decoupled;
    cfg.master_mode = k.mode;
    cfg.seed = 1234;
    cfg.block_size = B;
    cfg.map1 = mp.m1;
    cfg.map2 = mp.m2;
    struct Arg {
      MtaChunk<kAdam8bitDepth> c;
      const Adam8bitConfig* cfg;
      q8::Shared* sh;
    };
    static q8::Shared sh;
    static HostBlock block;
    mta_pack(L, q8::kChunk, k.max_blocks, [&](const MtaMeta<kAdam8bitDepth>& meta, int64_t nb) {
      std::vector<int32_t> order(nb);
      for (int64_t b = 0; b < nb; ++b) order[b] = int32_t(b);
      std::shuffle(order.begin(), order.end(), rng);
      for (const int32_t b : order) {
        std::memset(&sh, 0xCD, sizeof sh);  // no state carried between blocks
        Arg a{mta_locate<kAdam8bitDepth>(meta, b), &cfg, &sh};
        const bool ok = block.run(
            [](const HostExec& ex, void* p) {
              Arg* a = static_cast<Arg*>(p);
              switch (a->cfg->master_mode) {
                case kFp32Master: q8::run_block<HostExec, kFp32Master>(ex, *a->sh, a->c, *a->cfg); break;
                case kRemainder: q8::run_block<HostExec, kRemainder>(ex, *a->sh, a->c, *a->cfg); break;
                case kStochastic: q8::run_block<HostExec, kStochastic>(ex, *a->sh, a->c, *a->cfg); break;
                default: q8::run_block<HostExec, kNoMaster>(ex, *a->sh, a->c, *a->cfg); break;
              }
            },
            &a);
        EXPECT(ok, "%s: block %d: %s", k.name, b, block.error);
      }
    });
  }

  // Byte-for-byte, canaries included (absmax NaN: compare as bits, NaN == NaN here).
  for (size_t i = 0; i < ts.size(); ++i) {
    Buf* got[8] = {&ts[i].p, &ts[i].g, &ts[i].c1, &ts[i].c2, &ts[i].master, &ts[i].a1, &ts[i].a2, &ts[i].step};
    Buf* exp[8] = {&ref[i].p, &ref[i].g, &ref[i].c1, &ref[i].c2, &ref[i].master, &ref[i].a1, &ref[i].a2, &ref[i].step};
    static const char* names[8] = {"param", "grad", "codes1", "codes2", "master", "absmax1", "absmax2", "step"};
    for (int d = 0; d < 8; ++d) {
      const auto& a = got[d]->mem;
      const auto& e = exp[d]->mem;
      size_t first = a.size(), count = 0;
      for (size_t j = 0; j < a.size(); ++j)
        if (a[j] != e[j]) {
          count++;
          first = std::min(first, j);
        }
      EXPECT(count == 0, "%s: tensor %zu (n=%lld, dtype %d) %s: %zu bytes differ, first at byte %lld",
             k.name, i, (long long)ts[i].n, ts[i].dtype, names[d], count,
             (long long)first - (long long)got[d]->off);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s maps.bin (512 float32: signed map, unsigned map)\n", argv[0]);
    return 2;
  }
  Maps maps;
  FILE* f = std::fopen(argv[1], "rb");
  if (!f || std::fread(&maps, sizeof(float), 512, f) != 512) {
    std::printf("cannot read %s\n", argv[1]);
    return 2;
  }
  std::fclose(f);
  const std::vector<int64_t> sizes = {1, 3, 64, 65, 255, 0, 4095, 4096, 4097, 8192 + 77, 13, 2048 + 4};
  std::vector<Case> cases;
  for (int mode : {kNoMaster, kFp32Master, kRemainder, kStochastic})
    for (int block : {64, 128, 256, 1024, 4096}) {
      Case c{"modes x blocks", sizes, mode, block};
      c.misalign = block == 256 || block == 64;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master;
      c.lr_ptr = mode == kRemainder;
      c.maximize = block == 128;
      c.decoupled = block != 1024;
      cases.push_back(c);
    }
  {
    Case c{"512 / 2048 blocks, launch split", {5000, 12288, 3, 9000}, kFp32Master, 512};
    c.max_blocks = 2;
    cases.push_back(c);
    c.block = 2048;
    c.misalign = true;
    cases.push_back(c);
  }
  {
    std::vector<int64_t> many;
    for (int i = 0; i < 120; ++i) many.push_back((i * 37) % 300);
    cases.push_back(Case{"120 small tensors (several launches)", many, kStochastic, 256});
  }
  {
    Case c{"first step (absmax 0)", sizes, kFp32Master, 256};
    c.zero_state = true;
    cases.push_back(c);
  }
  {
    Case c{"found_inf = 0 runs", sizes, kRemainder, 256};
    c.has_found = true;
    c.grad_scale = true;
    cases.push_back(c);
  }
  for (float fi : {1.f, INFINITY, NAN}) {
    Case c{"found_inf > 0 skips", sizes, kFp32Master, 256};
    c.misalign = c.grad_scale = c.clip = c.has_found = true;
    c.found = fi;
    if (std::isnan(fi)) c.name = "found_inf NaN runs (NaN > 0 is false)";
    cases.push_back(c);
  }
  for (int bad : {1, 2, 3}) {
    Case c{"bad map poisons absmax", sizes, kFp32Master, 256};
    c.bad_map = bad;
    cases.push_back(c);
  }
  uint64_t seed = 1;
  for (const Case& c : cases) run_case(c, maps, seed++);
  std::printf("%zu cases\n", cases.size());
  if (failures) {
    std::printf("%ld failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
"""


def _adam8bit_emulation_cmds(tmp: Path) -> list[list[str]] | str:
    """Build + run commands of the host emulation of the 8-bit kernel, or why they cannot run."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return "no host C++ compiler"
    try:
        from mpfused.quant_maps import signed_map, unsigned_map
    except ImportError as exc:
        return f"mpfused.quant_maps not importable: {exc}"
    maps = tmp / "q8_maps.bin"
    values = signed_map().tolist() + unsigned_map().tolist()
    maps.write_bytes(struct.pack("<512f", *values))
    src = tmp / "adam8bit_emulation.cu"
    src.write_text(ADAM8BIT_EMULATION)
    cpu_obj, exe = tmp / "adam8bit_cpu.o", tmp / "adam8bit_emulation"
    inc = ["-I", str(ROOT / "csrc" / "include")]
    return [
        # The CPU kernel as the extension builds it (no FMA contraction), OpenMP for its pragmas.
        [cxx, "-O2", "-std=c++17", "-fopenmp", "-ffp-contract=off", *inc, "-c",
         str(ROOT / "csrc" / "cpu" / "adam8bit_cpu.cpp"), "-o", str(cpu_obj)],
        [NVCC, "-std=c++17", "-O2", "-Xcompiler", "-ffp-contract=off,-fopenmp", *inc, "-I",
         str(ROOT / "csrc" / "cuda"), str(src), str(cpu_obj), "-o", str(exe)],
        [str(exe), str(maps)],
    ]


def _cuda_include() -> str | None:
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        cands.append(str(Path(os.path.realpath(NVCC)).parents[1]))
    for c in cands:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return str(Path(c) / "include")
    return None


def _binding_cmds(tmp: Path) -> dict[str, list[str]] | str:
    """g++ -fsyntax-only commands for the CUDA bindings, or the reason they cannot run."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return "no host C++ compiler"
    try:
        from torch.utils import cpp_extension
    except ImportError:
        return "torch not importable"
    inc = cpp_extension.include_paths()
    if not any((Path(p) / "c10" / "cuda" / "CUDAStream.h").exists() for p in inc):
        return "torch ships no c10/cuda headers"
    cuda_inc = _cuda_include()
    if cuda_inc is None:
        return "no CUDA toolkit include dir (cuda_runtime_api.h)"
    stub = tmp / "stub"
    if not any((Path(p) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in inc):
        # Generated at torch build time and absent from CPU wheels; its only content is this.
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True, exist_ok=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags = ["-std=c++17", "-fsyntax-only", "-I", str(ROOT / "csrc" / "include")]
    for p in [*inc, cuda_inc, str(stub)]:
        flags += ["-isystem", p]
    return {Path(b).name: [cxx, *flags, b] for b in BINDINGS}


TIMEOUT = None  # return code of a job cut by the module deadline: skipped, not failed


def _run(cmd: list[str], deadline: float) -> tuple[int | None, str]:
    left = deadline - time.monotonic()
    if left <= 1:
        return TIMEOUT, "not run: module deadline reached (machine too busy?)"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return TIMEOUT, f"cut by the module deadline ({DEADLINE_S:.0f} s): {' '.join(cmd)}"
    return p.returncode, f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}"


def _check(result):
    rc, out = result
    if rc is TIMEOUT:
        pytest.skip(out)
    assert rc == 0, out
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_compile")
    deadline = time.monotonic() + DEADLINE_S
    jobs: dict[str, list[list[str]]] = {}
    for cu in CU_FILES:
        for arch in ARCHS:
            out = tmp / f"{Path(cu).stem}.{arch}.o"
            jobs[f"{Path(cu).name}:{arch}"] = [[NVCC, "-c", "-std=c++17", f"-arch={arch}", "-I",
                                                str(ROOT / "csrc" / "include"), cu, "-o", str(out)]]
    src = tmp / "pack_test.cu"
    src.write_text(PACK_TEST)
    exe = tmp / "pack_test"
    jobs["pack_test"] = [[NVCC, "-std=c++17", "-I", str(ROOT / "csrc" / "include"), "-I",
                          str(ROOT / "csrc" / "cuda"), str(src), "-o", str(exe)], [str(exe)]]
    emulation = _adam8bit_emulation_cmds(tmp)
    if isinstance(emulation, list):
        jobs["adam8bit_emulation"] = emulation
    bindings = _binding_cmds(tmp)
    if isinstance(bindings, dict):
        for name, cmd in bindings.items():
            jobs[f"bindings:{name}"] = [cmd]

    def run_job(cmds):
        outs = []
        for cmd in cmds:  # sequential steps of one job (build, then run)
            rc, out = _run(cmd, deadline)
            outs.append(out)
            if rc != 0:  # a failure or a deadline cut (None)
                return rc, "\n".join(outs)
        return 0, "\n".join(outs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        futs = {name: ex.submit(run_job, cmds) for name, cmds in jobs.items()}
        res = {name: f.result() for name, f in futs.items()}
    res["_bindings_skip"] = bindings if isinstance(bindings, str) else None
    res["_emulation_skip"] = emulation if isinstance(emulation, str) else None
    return res


def test_there_are_cuda_sources():
    names = {Path(f).name for f in CU_FILES}
    assert {"amp_cuda.cu", "adam_cuda.cu", "adam8bit_cuda.cu"} <= names
    bindings = {Path(b).name for b in BINDINGS}
    assert {"amp_ops_cuda.cpp", "adam_ops_cuda.cpp", "adam8bit_ops_cuda.cpp"} <= bindings
    assert (ROOT / "csrc" / "cuda" / "multi_tensor_apply.cuh").exists()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", [Path(f).name for f in CU_FILES])
def test_cu_compiles(results, cu, arch):
    _check(results[f"{cu}:{arch}"])


def test_multi_tensor_packing_on_host(results):
    out = _check(results["pack_test"])
    assert out.rstrip().endswith("ok"), out


def test_adam8bit_block_algorithm_on_host_matches_cpu_kernel(results):
    if results["_emulation_skip"]:
        pytest.skip(results["_emulation_skip"])
    out = _check(results["adam8bit_emulation"])
    assert out.rstrip().endswith("ok"), out


@pytest.mark.parametrize("binding", [Path(b).name for b in BINDINGS])
def test_cuda_bindings_syntax(results, binding):
    if results["_bindings_skip"]:
        pytest.skip(results["_bindings_skip"])
    _check(results[f"bindings:{binding}"])
