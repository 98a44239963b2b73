// Host emulation of the CUDA execution model, for tests on machines without a GPU.
//
// csrc/cuda/*.cu compile unchanged as C++ (g++ -x c++) with this directory first on the include
// path: this file stands in for the toolkit's <cuda_runtime.h>. Every kernel launch
// (MPF_LAUNCH, csrc/cuda/launch.cuh) runs on the calling thread, block after block in a shuffled
// order, each block as blockDim.x cooperative threads (ucontext fibers) with CUDA's collective
// semantics:
//   __syncthreads / __syncthreads_or / _and / _count: a block barrier; a barrier reached while
//       other threads of the block have exited, or a barrier only part of the block reaches, is
//       reported as an error (divergent barrier);
//   __shfl_down_sync / __shfl_xor_sync / __shfl_sync: full-warp shuffles (mask 0xffffffff, width
//       32); a shuffle some lanes of the warp never reach is reported as a deadlock;
//   __shared__: a static thread_local. Each block runs on a fresh OS thread whose thread-local
//       block is filled with 0xFF bytes first (NaN as float or double), so a block never sees
//       another block's shared memory and a read before any write sees garbage. (Hence the programs built with this
//       header must declare no thread_local of their own.) Every scheduling round runs the threads
//       in a new random order, so a shared-memory read that lacks its barrier sees a stale value
//       in most runs.
// threadIdx / blockIdx / blockDim / gridDim are globals the scheduler sets before it resumes a
// thread. A failed block makes the launch fail (cudaGetLastError returns cudaErrorLaunchFailure)
// and prints what went wrong.
//
// What this does not show: timing, memory-model effects between blocks (blocks run one after the
// other), device intrinsics behind __CUDA_ARCH__ (the host branch of platform.h is compiled) and
// FMA contraction (build with -ffp-contract=off; the extension builds its CUDA code with
// --fmad=false). It is a check of indexing, synchronization and per-element math, not a GPU run.
//
// With -fsanitize=address the fibers are announced to ASan (start/finish_switch_fiber), so stack
// and heap checks stay valid across switches.
#pragma once
#define MPF_CUDA_HOST_EMULATION 1

#include <link.h>
#include <stdint.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define MPF_EMU_ASAN 1
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

typedef struct CUstream_st* cudaStream_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace mpf_emulation {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
#ifdef MPF_EMU_ASAN
constexpr size_t kStack = size_t(1) << 18;  // ASan frames are larger
#else
constexpr size_t kStack = size_t(1) << 16;
#endif

// One block: its threads, where each one waits, the shuffle exchange buffers.
struct Block {
  static constexpr int kRun = -2, kBarrier = -1;  // wait[t] >= 0: at a shuffle of warp wait[t]
  int n = 0;
  int cur = 0;
  const char* error = nullptr;
  ucontext_t main_ctx;
  std::vector<ucontext_t> ctx = std::vector<ucontext_t>(kMaxThreads);
  std::vector<char> stacks = std::vector<char>(kMaxThreads * kStack);
  int wait[kMaxThreads];
  bool done[kMaxThreads];
  int flag[kMaxThreads];
  uint64_t xchg[2][kMaxThreads];
  int parity[kMaxThreads];
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  std::mt19937_64 rng{20261122};
#ifdef MPF_EMU_ASAN
  const void* main_bottom = nullptr;
  size_t main_size = 0;
#endif
};

inline Block& block() {
  static Block* b = new Block;  // never freed: lives for the process, like a device
  return *b;
}

struct LaunchState {
  cudaError_t last = cudaSuccess;
  std::mt19937_64 rng{1};
  int64_t launches = 0, blocks = 0;
};
inline LaunchState launch_state;
// multi_tensor_apply.cuh's blocks-per-launch limit under emulation (the device's is 2^30).
inline int64_t max_blocks_per_launch = int64_t(1) << 30;

// Seeds the block order and the thread interleavings (tests pass a fresh seed each run).
inline void seed(uint64_t s) {
  block().rng.seed(2 * s + 1);
  launch_state.rng.seed(s);
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s (block %u, thread %u)\n", what, blockIdx.x, threadIdx.x);
  std::abort();
}

// Thread side of a switch: park at `kind` and hand control back to the scheduler.
inline void park(int kind) {
  Block& b = block();
  const int t = b.cur;
  b.wait[t] = kind;
#ifdef MPF_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, b.main_bottom, b.main_size);
  swapcontext(&b.ctx[t], &b.main_ctx);
  __sanitizer_finish_switch_fiber(fake, &b.main_bottom, &b.main_size);
#else
  swapcontext(&b.ctx[t], &b.main_ctx);
#endif
}

inline void thread_entry() {
  Block& b = block();
#ifdef MPF_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.main_bottom, &b.main_size);
#endif
  b.body(b.arg);
  b.done[b.cur] = true;
#ifdef MPF_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, b.main_bottom, b.main_size);  // this fiber ends
#endif
}  // uc_link: back to the scheduler

// Fills the calling OS thread's instance of the program's thread-locals (the emulated shared
// memory) with 0xFF bytes. The first object dl_iterate_phdr reports is the program itself.
inline void poison_shared_memory() {
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void*) {
        for (int i = 0; i < info->dlpi_phnum; ++i)
          if (info->dlpi_phdr[i].p_type == PT_TLS && info->dlpi_tls_data != nullptr)
            std::memset(info->dlpi_tls_data, 0xFF, info->dlpi_phdr[i].p_memsz);
        return 1;  // the program only
      },
      nullptr);
}

// Runs body(arg) as n cooperative threads. False (b.error says why) on a divergent barrier or a
// shuffle that cannot complete.
inline bool run_block(int n, void (*body)(void*), void* arg) {
  Block& b = block();
  b.n = n;
  b.body = body;
  b.arg = arg;
  b.error = nullptr;
  for (int t = 0; t < n; ++t) {
    b.wait[t] = Block::kRun;
    b.done[t] = false;
    b.parity[t] = 0;
    getcontext(&b.ctx[t]);
    b.ctx[t].uc_stack.ss_sp = b.stacks.data() + size_t(t) * kStack;
    b.ctx[t].uc_stack.ss_size = kStack;
    b.ctx[t].uc_link = &b.main_ctx;
    makecontext(&b.ctx[t], &thread_entry, 0);
  }
  std::vector<int> order(n);
  for (int t = 0; t < n; ++t) order[t] = t;
  for (;;) {
    std::shuffle(order.begin(), order.end(), b.rng);  // a new interleaving every round
    for (const int t : order) {
      if (b.done[t] || b.wait[t] != Block::kRun) continue;
      b.cur = t;
      threadIdx = uint3{unsigned(t), 0, 0};
#ifdef MPF_EMU_ASAN
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, b.stacks.data() + size_t(t) * kStack, kStack);
      swapcontext(&b.main_ctx, &b.ctx[t]);
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
      swapcontext(&b.main_ctx, &b.ctx[t]);
#endif
    }
    int ndone = 0, nbarrier = 0;
    for (int t = 0; t < n; ++t) {
      ndone += b.done[t];
      nbarrier += !b.done[t] && b.wait[t] == Block::kBarrier;
    }
    if (ndone == n) return true;
    if (nbarrier == n) {
      for (int t = 0; t < n; ++t) b.wait[t] = Block::kRun;
      continue;
    }
    if (nbarrier > 0 && ndone > 0) {
      b.error = "__syncthreads that not every thread of the block reaches (some exited first)";
      return false;
    }
    bool released = false;
    for (int w = 0; w * kWarp < n; ++w) {
      const int lo = w * kWarp, hi = std::min(n, lo + kWarp);
      bool all = true;
      for (int t = lo; t < hi; ++t) all = all && !b.done[t] && b.wait[t] == w;
      if (all) {
        for (int t = lo; t < hi; ++t) b.wait[t] = Block::kRun;
        released = true;
      }
    }
    if (!released) {
      b.error = "deadlock: a barrier or shuffle that not every thread of its block/warp reaches";
      return false;
    }
  }
}

// A full-warp shuffle: lane l offers v and gets the value of lane src(l). Two exchange buffers
// used alternately: a lane reuses one only after the next warp barrier, when every lane of its
// warp has read it.
template <typename T, typename Src>
inline T shuffle(unsigned mask, T v, int width, Src src) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle operand");
  Block& b = block();
  const int t = b.cur, lane = t % kWarp, base = t - lane;
  if (mask != 0xffffffffu || width != kWarp) fail("only full-warp shuffles are emulated");
  if (base + kWarp > b.n) fail("shuffle in a partial warp");
  const int buf = b.parity[t];
  b.parity[t] ^= 1;
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  b.xchg[buf][t] = raw;
  park(t / kWarp);
  const int from = src(lane);
  if (from < 0 || from >= kWarp) return v;
  T out;
  raw = b.xchg[buf][base + from];
  std::memcpy(&out, &raw, sizeof(T));
  return out;
}

// The kernel's by-value parameters are built once per launch; each thread gets its own copies.
template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;

  template <typename... A>
  void operator()(A&&... a) const {
    LaunchState& s = launch_state;
    ++s.launches;
    if (grid.x < 1 || grid.y != 1 || grid.z != 1 || block.x < 1 || block.x > unsigned(kMaxThreads) ||
        block.y != 1 || block.z != 1) {
      s.last = cudaErrorInvalidConfiguration;
      return;
    }
    using Params = std::tuple<std::decay_t<P>...>;
    struct Arg {
      void (*kernel)(P...);
      const Params* params;
    };
    const Params params(std::forward<A>(a)...);
    Arg arg{kernel, &params};
    std::vector<unsigned> order(grid.x);
    for (unsigned i = 0; i < grid.x; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), s.rng);  // blocks run in no particular order
    for (const unsigned bi : order) {
      blockIdx = uint3{bi, 0, 0};
      blockDim = block;
      gridDim = grid;
      ++s.blocks;
      bool ok = false;
      std::thread os_thread([&] {  // fresh shared memory (see the top of this file)
        poison_shared_memory();
        ok = run_block(int(block.x),
                       [](void* p) {
                         const Arg* a = static_cast<const Arg*>(p);
                         std::apply(a->kernel, Params(*a->params));
                       },
                       &arg);
      });
      os_thread.join();
      if (!ok) {
        std::fprintf(stderr, "cuda emulation: block %u of %u: %s\n", bi, grid.x,
                     mpf_emulation::block().error);
        s.last = cudaErrorLaunchFailure;
        return;
      }
    }
  }
};

template <typename... P>
Launch<P...> launch(dim3 grid, dim3 block, cudaStream_t, void (*kernel)(P...)) {
  return Launch<P...>{kernel, grid, block};
}

}  // namespace mpf_emulation

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = mpf_emulation::launch_state.last;
  mpf_emulation::launch_state.last = cudaSuccess;
  return e;
}

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unspecified launch failure";
  }
}

inline void __syncthreads() { mpf_emulation::park(mpf_emulation::Block::kBarrier); }

// Block-wide vote: everyone posts, barrier, everyone reads, barrier (so no flag is overwritten by
// the next vote before every thread has read this one).
template <typename Combine>
inline int mpf_emu_vote(int p, Combine combine) {
  mpf_emulation::Block& b = mpf_emulation::block();
  b.flag[b.cur] = p;
  __syncthreads();
  int r = combine(b.flag, b.n);
  __syncthreads();
  return r;
}
inline int __syncthreads_or(int p) {
  return mpf_emu_vote(p, [](const int* f, int n) { return int(std::any_of(f, f + n, [](int x) { return x != 0; })); });
}
inline int __syncthreads_and(int p) {
  return mpf_emu_vote(p, [](const int* f, int n) { return int(std::all_of(f, f + n, [](int x) { return x != 0; })); });
}
inline int __syncthreads_count(int p) {
  return mpf_emu_vote(p, [](const int* f, int n) { return int(std::count_if(f, f + n, [](int x) { return x != 0; })); });
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return mpf_emulation::shuffle(mask, v, width, [delta](int lane) {
    return lane + int(delta) < mpf_emulation::kWarp ? lane + int(delta) : lane;
  });
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return mpf_emulation::shuffle(mask, v, width, [lane_mask](int lane) { return lane ^ lane_mask; });
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return mpf_emulation::shuffle(mask, v, width, [src_lane](int) { return src_lane; });
}
