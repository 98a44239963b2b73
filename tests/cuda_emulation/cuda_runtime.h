// Host emulation of the CUDA execution model, for tests on machines without a GPU.
//
// csrc/cuda/*.cu compile unchanged as C++ (g++ -x c++) with this directory first on the include
// path: this file stands in for the toolkit's <cuda_runtime.h>. Every kernel launch
// (MPF_LAUNCH, csrc/cuda/launch.cuh) runs on the calling thread, block after block in a shuffled
// order, each block as blockDim.x cooperative threads (ucontext fibers) with CUDA's collective
// semantics:
//   __syncthreads / __syncthreads_or / _and / _count: a block barrier; a barrier reached while
//       other threads of the block have exited, a barrier only part of the block reaches, or
//       threads meeting at different barrier calls (source lines) is reported as an error;
//   __shfl_down_sync / __shfl_xor_sync / __shfl_sync / __syncwarp: full-warp collectives (mask
//       0xffffffff, width 32, lane arguments in [0, 32)); lanes that never reach it, or reach
//       different calls, are reported;
//   __shared__: a static thread_local. Before each block the program's thread-local block is
//       filled with 0xFF bytes (NaN as float or double), so a block never sees another block's
//       shared memory and a read before any write sees garbage. (Hence the programs built with
//       this header must declare no thread_local of their own.) Every scheduling round runs the
//       threads in a new random order, so a shared-memory read that lacks its barrier sees a
//       stale value in most runs.
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
// and heap checks stay valid across switches. With -fsanitize=thread every emulated thread is a
// TSan fiber and only CUDA's synchronization orders them: a barrier (or a warp's shuffle) is a
// release by every arriving thread and an acquire by every leaving one, switches between fibers
// synchronize nothing, so two threads of a block touching the same shared or global memory
// without a barrier between them is reported as a data race (compute-sanitizer's racecheck, on
// the host). As on a GPU, a shuffle orders no memory (only __syncwarp and barriers do). Blocks run
// one after the other, so races between blocks are not seen.
#pragma once
#define MPF_CUDA_HOST_EMULATION 1

#include <link.h>
#include <stdint.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define MPF_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define MPF_EMU_TSAN 1
// TSan's dynamic annotations: the scheduler's own bookkeeping (which thread runs) is not memory the
// kernel shares, so its writes are not recorded.
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
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
#if defined(MPF_EMU_ASAN) || defined(MPF_EMU_TSAN)
constexpr size_t kStack = size_t(1) << 18;  // sanitizer frames are larger
#else
constexpr size_t kStack = size_t(1) << 16;
#endif

// One block: its threads, where each one waits, the shuffle exchange buffers.
struct Block {
  static constexpr int kRun = -2, kBarrier = -1;  // wait[t] >= 0: at a collective of warp wait[t]
  int n = 0;
  int cur = 0;
  const char* error = nullptr;
  ucontext_t main_ctx;
  std::vector<ucontext_t> ctx = std::vector<ucontext_t>(kMaxThreads);
  std::vector<char> stacks = std::vector<char>(kMaxThreads * kStack);
  // Relaxed atomics: the scheduler reads them, and under TSan that must not order the threads.
  std::atomic<int> wait[kMaxThreads];
  std::atomic<bool> done[kMaxThreads];
  int flag[kMaxThreads];
  const char* site_file[kMaxThreads];  // the collective call each parked thread waits at
  int site_line[kMaxThreads];
  std::string message;
  uint64_t xchg[2][kMaxThreads];
  int parity[kMaxThreads];
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  std::mt19937_64 rng{20261122};
#ifdef MPF_EMU_ASAN
  const void* main_bottom = nullptr;
  size_t main_size = 0;
#endif
#ifdef MPF_EMU_TSAN
  void* main_fiber = nullptr;
  void* fiber[kMaxThreads] = {};
  int barriers[kMaxThreads];                 // barriers passed by each thread
  char barrier_sync[2];                      // sync objects of even / odd barriers
  char warp_sync[2][kMaxThreads / kWarp];    // of each warp's even / odd __syncwarp
  char exit_sync;                            // every thread's exit -> the end of the block
#endif

  int waiting(int t) const { return wait[t].load(std::memory_order_relaxed); }
  void set_wait(int t, int v) { wait[t].store(v, std::memory_order_relaxed); }
  bool finished(int t) const { return done[t].load(std::memory_order_relaxed); }
  void set_done(int t, bool v) { done[t].store(v, std::memory_order_relaxed); }
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
// Whether multi_tensor_apply.cuh / increment_steps use the 32 KB kernel parameter space (CUDA
// >= 12.1) or the 4 KB one: the emulation compiles both and tests run each.
inline bool large_kernel_params = false;

// Seeds the block order and the thread interleavings (tests pass a fresh seed each run).
inline void seed(uint64_t s) {
  block().rng.seed(2 * s + 1);
  launch_state.rng.seed(s);
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s (block %u, thread %u)\n", what, blockIdx.x, threadIdx.x);
  std::abort();
}

// Thread side of a switch: park at `kind` (the collective called at file:line) and hand control
// back to the scheduler. `sync`: the TSan sync object of this barrier, null for a shuffle (which
// orders no memory).
inline void park(int kind, void* sync, const char* file, int line) {
  Block& b = block();
  const int t = b.cur;
  b.site_file[t] = file;
  b.site_line[t] = line;
  b.set_wait(t, kind);
#ifdef MPF_EMU_TSAN
  if (sync) __tsan_release(sync);
  __tsan_switch_to_fiber(b.main_fiber, __tsan_switch_to_fiber_no_sync);
  swapcontext(&b.ctx[t], &b.main_ctx);
  if (sync) __tsan_acquire(sync);
#elif defined(MPF_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, b.main_bottom, b.main_size);
  swapcontext(&b.ctx[t], &b.main_ctx);
  __sanitizer_finish_switch_fiber(fake, &b.main_bottom, &b.main_size);
#else
  (void)sync;
  swapcontext(&b.ctx[t], &b.main_ctx);
#endif
}

inline void* barrier_sync() {
#ifdef MPF_EMU_TSAN
  Block& b = block();
  return &b.barrier_sync[b.barriers[b.cur]++ & 1];
#else
  return nullptr;
#endif
}

inline void* warp_sync(int parity) {
#ifdef MPF_EMU_TSAN
  Block& b = block();
  return &b.warp_sync[parity][b.cur / kWarp];
#else
  (void)parity;
  return nullptr;
#endif
}

inline void thread_entry() {
  Block& b = block();
#ifdef MPF_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.main_bottom, &b.main_size);
#endif
  b.body(b.arg);
  b.set_done(b.cur, true);
#ifdef MPF_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, b.main_bottom, b.main_size);  // this fiber ends
#endif
#ifdef MPF_EMU_TSAN
  void* main_fiber = b.main_fiber;  // read before the release that orders it before the next block
  __tsan_release(&b.exit_sync);
  __tsan_switch_to_fiber(main_fiber, __tsan_switch_to_fiber_no_sync);
  setcontext(&b.main_ctx);  // never return: this function's exit would be recorded on the new fiber
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

// Whether threads [lo, hi) wait at the same call; if not, b.error says where they wait.
inline bool same_site(Block& b, int lo, int hi, const char* what) {
#ifdef MPF_EMU_TSAN  // the threads' bookkeeping, read by the scheduler: not kernel memory
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  struct End {
    ~End() { AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
  } end;
#endif
  for (int t = lo + 1; t < hi; ++t)
    if (b.site_line[t] != b.site_line[lo] || std::strcmp(b.site_file[t], b.site_file[lo]) != 0) {
      b.message = std::string(what) + " reached at different calls: thread " + std::to_string(lo) +
                  " at " + b.site_file[lo] + ":" + std::to_string(b.site_line[lo]) + ", thread " +
                  std::to_string(t) + " at " + b.site_file[t] + ":" + std::to_string(b.site_line[t]);
      b.error = b.message.c_str();
      return false;
    }
  return true;
}

// Runs body(arg) as n cooperative threads. False (b.error says why) on a divergent barrier or a
// shuffle that cannot complete.
inline bool run_block(int n, void (*body)(void*), void* arg) {
  Block& b = block();
  b.n = n;
  b.body = body;
  b.arg = arg;
  b.error = nullptr;
#ifdef MPF_EMU_TSAN
  b.main_fiber = __tsan_get_current_fiber();
#endif
  for (int t = 0; t < n; ++t) {
    b.set_wait(t, Block::kRun);
    b.set_done(t, false);
    b.parity[t] = 0;
#ifdef MPF_EMU_TSAN
    if (b.fiber[t] == nullptr) b.fiber[t] = __tsan_create_fiber(0);  // reused by later blocks
    b.barriers[t] = 0;
#endif
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
      if (b.finished(t) || b.waiting(t) != Block::kRun) continue;
#ifdef MPF_EMU_TSAN
      AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
      b.cur = t;
      threadIdx = uint3{unsigned(t), 0, 0};
#ifdef MPF_EMU_TSAN
      AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
      __tsan_switch_to_fiber(b.fiber[t], 0);  // the scheduler's writes above reach the thread
      swapcontext(&b.main_ctx, &b.ctx[t]);
#elif defined(MPF_EMU_ASAN)
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
      ndone += b.finished(t);
      nbarrier += !b.finished(t) && b.waiting(t) == Block::kBarrier;
    }
    if (ndone == n) {
#ifdef MPF_EMU_TSAN
      __tsan_acquire(&b.exit_sync);  // everything the block did happens before what follows it
#endif
      return true;
    }
    if (nbarrier == n) {
      if (!same_site(b, 0, n, "__syncthreads")) return false;
      for (int t = 0; t < n; ++t) b.set_wait(t, Block::kRun);
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
      for (int t = lo; t < hi; ++t) all = all && !b.finished(t) && b.waiting(t) == w;
      if (all) {
        if (!same_site(b, lo, hi, "warp collective")) return false;
        for (int t = lo; t < hi; ++t) b.set_wait(t, Block::kRun);
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
inline T shuffle(unsigned mask, T v, int width, int arg, Src src, const char* file, int line) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle operand");
  Block& b = block();
  const int t = b.cur, lane = t % kWarp, base = t - lane;
  if (mask != 0xffffffffu || width != kWarp) fail("only full-warp shuffles are emulated");
  if (arg < 0 || arg >= kWarp) fail("shuffle lane argument outside [0, 32): not emulated");
  if (base + kWarp > b.n) fail("shuffle in a partial warp");
  const int buf = b.parity[t];
  b.parity[t] ^= 1;
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
#ifdef MPF_EMU_TSAN  // the exchange is register traffic on a GPU, not memory the kernel shares
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  b.xchg[buf][t] = raw;
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#else
  b.xchg[buf][t] = raw;
#endif
  park(t / kWarp, nullptr, file, line);
  const int from = src(lane);
#ifdef MPF_EMU_TSAN
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  raw = b.xchg[buf][base + from];
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#else
  raw = b.xchg[buf][base + from];
#endif
  T out;
  std::memcpy(&out, &raw, sizeof(T));
  return out;
}

// __syncwarp with the full mask: a warp barrier that, unlike a shuffle, orders memory.
inline void syncwarp(unsigned mask, const char* file, int line) {
  Block& b = block();
  const int t = b.cur;
  if (mask != 0xffffffffu) fail("only full-warp __syncwarp is emulated");
  if (t - t % kWarp + kWarp > b.n) fail("__syncwarp in a partial warp");
  const int buf = b.parity[t];
  b.parity[t] ^= 1;
  park(t / kWarp, warp_sync(buf), file, line);
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
      poison_shared_memory();  // fresh shared memory (see the top of this file)
      const bool ok = run_block(int(block.x),
                                [](void* p) {
                                  const Arg* a = static_cast<const Arg*>(p);
                                  // by-value parameters are copied per thread here;
                                  // MPF_PARAM_TABLE ones (const&) are read in place
                                  std::apply(a->kernel, *a->params);
                                },
                                &arg);
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

// Every collective records its call site (default arguments evaluated at the caller), so threads
// meeting at different calls are reported.
#define MPF_EMU_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()

inline void __syncthreads(MPF_EMU_SITE) {
  mpf_emulation::park(mpf_emulation::Block::kBarrier, mpf_emulation::barrier_sync(), file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, MPF_EMU_SITE) {
  mpf_emulation::syncwarp(mask, file, line);
}

// Block-wide vote: everyone posts, barrier, everyone reads, barrier (so no flag is overwritten by
// the next vote before every thread has read this one).
template <typename Combine>
inline int mpf_emu_vote(int p, Combine combine, const char* file, int line) {
  mpf_emulation::Block& b = mpf_emulation::block();
  b.flag[b.cur] = p;
  __syncthreads(file, line);
  int r = combine(b.flag, b.n);
  __syncthreads(file, line);
  return r;
}
inline int __syncthreads_or(int p, MPF_EMU_SITE) {
  return mpf_emu_vote(
      p, [](const int* f, int n) { return int(std::any_of(f, f + n, [](int x) { return x != 0; })); },
      file, line);
}
inline int __syncthreads_and(int p, MPF_EMU_SITE) {
  return mpf_emu_vote(
      p, [](const int* f, int n) { return int(std::all_of(f, f + n, [](int x) { return x != 0; })); },
      file, line);
}
inline int __syncthreads_count(int p, MPF_EMU_SITE) {
  return mpf_emu_vote(
      p, [](const int* f, int n) { return int(std::count_if(f, f + n, [](int x) { return x != 0; })); },
      file, line);
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, MPF_EMU_SITE) {
  return mpf_emulation::shuffle(mask, v, width, int(delta), [delta](int lane) {
    return lane + int(delta) < mpf_emulation::kWarp ? lane + int(delta) : lane;
  }, file, line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, MPF_EMU_SITE) {
  return mpf_emulation::shuffle(mask, v, width, lane_mask, [lane_mask](int lane) { return lane ^ lane_mask; },
                                file, line);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, MPF_EMU_SITE) {
  return mpf_emulation::shuffle(mask, v, width, src_lane, [src_lane](int) { return src_lane; }, file, line);
}
