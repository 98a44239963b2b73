// Chunking shared by the CPU multi-tensor kernels: every tensor is cut into fixed-size chunks, the
// chunks of all tensors form one flat work list processed by OpenMP. Reductions write one partial
// per chunk and are combined in chunk order, so results do not depend on the thread count.
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

}  // namespace mpfused::cpu
