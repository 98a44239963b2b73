// Chunking shared by the CPU multi-tensor kernels: every tensor is cut into fixed-size chunks, the
// chunks of all tensors form one flat work list processed by OpenMP. Reductions write one partial
// per chunk and are combined in chunk order, so results do not depend on the thread count. The
// update kernels take the same list cut into one slice of equal elements per thread (make_slices).
#pragma once
#include <stdint.h>
#include <vector>

// Per-ISA clones of the hot loops (AVX-512, AVX2+FMA, baseline), picked once at load time by
// the dynamic loader (ifunc): one binary that is fast everywhere without -march=native.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define MPF_CPU_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MPF_CPU_MULTIVERSION
#endif

namespace mpfused::cpu {

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// 32Ki elements: large enough to amortize scheduling, small enough to balance 10,000 tiny tensors.
constexpr int64_t kChunkSize = 1 << 15;

// A light pass (the read-only non-finite check: ~3 us per chunk) forks threads only from this
// many chunks on: below it the OpenMP region's fork and join cost more than they save, and on a
// busy machine a region waits until every thread is scheduled (tails of milliseconds, measured
// on a loaded 2-core VM). Gradient release checks each ~256 KiB bucket (4 chunks) on the calling
// thread this way; a whole model's check (the scaler's) still runs in parallel.
constexpr int64_t kMinParallelLightChunks = 16;

inline std::vector<Chunk> make_chunks(const int64_t* numel, int64_t n, int64_t chunk = kChunkSize) {
  std::vector<Chunk> out;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < numel[t]; b += chunk)
      out.push_back({t, b, numel[t] - b < chunk ? numel[t] : b + chunk});
  return out;
}

// A step's work split by elements, not by chunk count: `schedule(static)` over chunks gives each
// thread the same number of chunks, and a small bucket mixes 32Ki-element chunks with
// 128-element biases (gradient release's 256 KiB buckets of the main job's model: 66K elements
// on one thread, 17K on the other; the whole model 347K against 289K). Slice s is
// chunks[first[s] .. first[s + 1]): about total / count() elements, cut at multiples of `align`
// inside a tensor (the 8-bit steps pass their block size; `align` must divide kChunkSize, so a
// block never straddles two chunks), every chunk at most kChunkSize.
// Update kernels only: their results do not depend on the cuts; the reductions keep make_chunks.
struct Slices {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first;
  int64_t count() const { return int64_t(first.size()) - 1; }
};

// Below this many elements per thread a slice is not worth a thread's fork and join (~1 ns
// per element of an Adam update against a few microseconds).
constexpr int64_t kMinSliceElements = 8192;

inline Slices make_slices(const int64_t* numel, int64_t n, int max_slices, int64_t align) {
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) total += numel[t];
  int64_t want = total / kMinSliceElements;
  want = want < max_slices ? want : max_slices;
  want = want > 1 ? want : 1;
  Slices s;
  s.first.push_back(0);
  int64_t next = 1, offset = 0;  // the next boundary is at flat element next * total / want
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < numel[t];) {
      // boundaries at or before this position (an aligned cut went past them) close here
      while (next < want && next * total / want <= offset + b) {
        s.first.push_back(int64_t(s.chunks.size()));
        ++next;
      }
      int64_t end = numel[t] - b < kChunkSize ? numel[t] : b + kChunkSize;
      if (next < want) {
        const int64_t cut = (next * total / want - offset + align - 1) / align * align;  // > b
        end = cut < end ? cut : end;
      }
      s.chunks.push_back({t, b, end});
      b = end;
    }
    offset += numel[t];
  }
  while (int64_t(s.first.size()) < want + 1) s.first.push_back(int64_t(s.chunks.size()));
  return s;
}

// f(chunk) for every chunk of the slices, one slice per thread (a team smaller than the slice
// count takes several each; no more threads than slices are started).
template <class F>
void for_each_slice(const Slices& s, int num_threads, F&& f) {
  const int64_t ns = s.count();
  const int team = ns < num_threads ? int(ns) : num_threads;
#pragma omp parallel for schedule(static, 1) num_threads(team) if (ns > 1)
  for (int64_t k = 0; k < ns; ++k)
    for (int64_t c = s.first[k]; c < s.first[k + 1]; ++c) f(s.chunks[c]);
}

}  // namespace mpfused::cpu
