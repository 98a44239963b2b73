"""The multi-tensor packing of the CUDA backend (mta_pack + mta_locate of
csrc/cuda/multi_tensor_apply.cuh), built with nvcc and run on the host (no GPU needed) against an
exhaustive check of which block runs which chunk, including tensors > 2^31 elements and launches
that split a tensor, with the 4 KB and the 32 KB kernel-parameter layouts.

The build and run is a background job from collection on (tests/cuda_compile_common.py,
tests/background_builds.py) under this module's deadline.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import deadline_s
from tests.cuda_compile_common import NEEDS_NVCC, NVCC, ROOT, _check, run_jobs

DEADLINE_S = deadline_s(110.0)

pytestmark = NEEDS_NVCC

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
#define EXPECT(...)                                                            \
  do {                                                                         \
    if (!(__VA_ARGS__) && ++failures < 20) std::printf("FAIL line %d: %s\n", __LINE__, #__VA_ARGS__); \
  } while (0)

template <int DEPTH, int P = kMaxParamBytes>
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
  mta_pack<DEPTH, P>(L, chunk, max_blocks, [&](const MtaMeta<DEPTH, P>& meta, int64_t nb) {
    EXPECT(last_was_full);  // only the final launch may be partly filled
    last_was_full = meta.ntensors == (MtaMeta<DEPTH, P>::kMaxTensors) || nb == max_blocks;
    EXPECT(nb >= 1 && nb <= max_blocks);
    EXPECT(meta.ntensors >= 1 && meta.ntensors <= MtaMeta<DEPTH, P>::kMaxTensors);
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

template <int DEPTH, int P = kMaxParamBytes>
void random_cases(uint64_t seed, int max_tensors = 700) {
  std::mt19937_64 rng(seed);
  for (int rep = 0; rep < 200; ++rep) {
    const int64_t chunk = int64_t(1) << (rng() % 5);
    const int64_t max_blocks = rep % 3 == 0 ? kMaxBlocksPerLaunch : 1 + int64_t(rng() % 40);
    std::vector<int64_t> numel(rng() % max_tensors);
    for (auto& x : numel) x = rng() % 10 == 0 ? 0 : int64_t(rng() % (5 * chunk + 3));
    check<DEPTH, P>(numel, chunk, max_blocks);
  }
}

int main() {
  random_cases<1>(1);
  random_cases<2>(2);
  random_cases<7>(3);
  // 32 KB kernel parameters (CUDA >= 12.1): ~8x the tensors per launch.
  random_cases<1, kMaxParamBytesLarge>(4, 5000);
  random_cases<9, kMaxParamBytesLarge>(5, 1500);
  static_assert(sizeof(MtaMeta<9, kMaxParamBytesLarge>) + kParamReserve <= kMaxParamBytesLarge, "");
  static_assert(MtaMeta<8, kMaxParamBytesLarge>::kMaxTensors >= 8 * MtaMeta<8>::kMaxTensors, "");
  // The driver query of CUDA 12.1 - 12.x builds: no GPU, no driver here, so 4 KB.
  std::printf("large kernel parameters here: %d\n", int(large_kernel_params()));
  const std::vector<int64_t> huge = {5, (int64_t(1) << 31) + 12345, 7, 3 * (int64_t(1) << 31) + 1};
  check<1>(huge, kChunkSize, kMaxBlocksPerLaunch);
  check<7>(huge, kChunkSize, 1000);
  check<2>(huge, int64_t(1) << 16, 3);
  std::printf("tensors per launch: depth1 %d depth2 %d depth7 %d; 32 KB: depth1 %d depth8 %d\n",
              MtaMeta<1>::kMaxTensors, MtaMeta<2>::kMaxTensors, MtaMeta<7>::kMaxTensors,
              MtaMeta<1, kMaxParamBytesLarge>::kMaxTensors,
              MtaMeta<8, kMaxParamBytesLarge>::kMaxTensors);
  if (failures) {
    std::printf("%ld failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
"""


def _build(job) -> dict:
    """The packing test's build and run (in the background from collection on:
    tests/background_builds.py). name -> (rc, output); rc TIMEOUT: cut by the module deadline."""
    tmp = Path(job.tmp)
    src = tmp / "pack_test.cu"
    src.write_text(PACK_TEST)
    exe = tmp / "pack_test"
    jobs = {"pack_test": [[NVCC, "-std=c++17", "-DMPF_CUDA_KERNEL_PARAMS_BY_DRIVER", "-I",
                           str(ROOT / "csrc" / "include"), "-I", str(ROOT / "csrc" / "cuda"),
                           str(src), "-o", str(exe)], [str(exe)]]}
    return run_jobs(job, jobs)


BACKGROUND_BUILD = _build if NVCC is not None else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return background_builds.result(__name__, _build, DEADLINE_S, tmp_path_factory)


def test_multi_tensor_packing_on_host(results):
    out = _check(results["pack_test"])
    assert out.rstrip().endswith("ok"), out
