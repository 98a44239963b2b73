// Property check of make_slices (csrc/cpu/parallel.h), built and run by tests/test_cpu_slices.py:
// for random tensor sizes, slice counts and alignments, the slices cover every element of every
// tensor once and in order, cut inside a tensor only at multiples of `align`, hold chunks of at
// most kChunkSize, and are balanced (none larger than its share plus one alignment unit).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "parallel.h"

using namespace mpfused::cpu;

static int fail(const char* what, unsigned seed, int trial) {
  std::printf("FAIL %s (seed %u, trial %d)\n", what, seed, trial);
  return 1;
}

int main(int argc, char** argv) {
  const unsigned seed = argc > 1 ? unsigned(std::strtoul(argv[1], nullptr, 10)) : 0u;
  std::mt19937_64 rng(seed);
  const int64_t aligns[] = {1, 64, 256, 4096};
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t n = int64_t(rng() % 12);
    std::vector<int64_t> numel(static_cast<size_t>(n));
    int64_t total = 0;
    for (auto& x : numel) {
      const int kind = int(rng() % 4);  // empty, tiny, medium, several chunks
      x = kind == 0 ? 0 : kind == 1 ? int64_t(rng() % 300) : kind == 2 ? int64_t(rng() % 70000)
                                                                      : int64_t(rng() % 300000);
      total += x;
    }
    const int threads = 1 + int(rng() % 6);
    const int64_t align = aligns[rng() % 4];
    const Slices s = make_slices(numel.data(), n, threads, align);
    int64_t want = total / kMinSliceElements;
    want = want < threads ? want : threads;
    want = want > 1 ? want : 1;
    if (s.count() != want) return fail("slice count", seed, trial);
    if (s.first.front() != 0 || s.first.back() != int64_t(s.chunks.size()))
      return fail("slices do not span the chunks", seed, trial);
    int64_t t = 0, pos = 0;
    for (const Chunk& c : s.chunks) {  // chunks in order, contiguous, tensor by tensor
      while (t < n && pos == numel[t]) ++t, pos = 0;
      if (c.tensor != t || c.begin != pos || c.end <= c.begin) return fail("order", seed, trial);
      if (c.end - c.begin > kChunkSize) return fail("chunk size", seed, trial);
      if (c.begin % align != 0) return fail("alignment", seed, trial);
      pos = c.end;
    }
    while (t < n && pos == numel[t]) ++t, pos = 0;
    if (t != n) return fail("coverage", seed, trial);
    for (int64_t k = 0; k < s.count(); ++k) {
      if (s.first[k + 1] < s.first[k]) return fail("slice bounds", seed, trial);
      int64_t size = 0;
      for (int64_t c = s.first[k]; c < s.first[k + 1]; ++c)
        size += s.chunks[size_t(c)].end - s.chunks[size_t(c)].begin;
      // a slice ends at the first aligned position at or after its boundary, or at a tensor's
      // end, so it exceeds its share by less than one alignment unit
      if (size > (total + want - 1) / want + align) return fail("balance", seed, trial);
    }
  }
  std::printf("OK\n");
  return 0;
}
