"""The CUDA 8-bit kernel's encode: decision thresholds in breadth-first (Eytzinger) order.

* identical codes: quant8_encode_eytzinger (the kernel's search) against quant8_encode (the CPU
  kernels' and the tables' reference) for both real maps, on every decision path (all 256
  comparison sequences, structurally), every float32 neighbour of every threshold and map entry,
  both ends of all 2^16 bins of the float32 bit pattern (every sign/exponent, inf, NaN) and
  random bit patterns; MPFUSED_EXHAUSTIVE_ENCODE=1 adds all 2^32 float32 (minutes);
* shared-memory bank conflicts: the review's simulation (docs: gpu-review Appendix A) as a test,
  with the layout quant8_math.h builds and the kernel's warp -> element mapping: a warp-wide
  search costs <= 11 wavefronts with the Eytzinger layout (the sorted layout: ~31).
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mpfused import quant_maps as qm

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")

PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include <random>

#include "mpfused/quant8_math.h"

using namespace mpfused;

static long failures = 0;
#define EXPECT(cond, ...)                                       \
  do {                                                          \
    if (!(cond) && ++failures < 20) {                           \
      std::printf("FAIL line %d: ", __LINE__);                  \
      std::printf(__VA_ARGS__);                                 \
      std::printf("\n");                                        \
    }                                                           \
  } while (0)

static void check_value(const float* thr, const float* eyt, uint32_t u) {
  const float x = bits_f32(u);
  const int32_t a = quant8_encode(thr, x), b = quant8_encode_eytzinger(eyt, x);
  EXPECT(a == b, "x bits %08x: sorted %d, eytzinger %d", u, a, b);
}

int main(int argc, char** argv) {
  FILE* f = std::fopen(argv[1], "rb");
  float maps[2][kQuantCodes];
  if (!f || std::fread(maps, sizeof maps, 1, f) != 1) return 2;
  std::fclose(f);
  const bool exhaustive = argc > 2 && argv[2][0] == '1';
  for (int m = 0; m < 2; ++m) {
    float thr[kQuantCodes], eyt[kQuantCodes];
    quant8_thresholds(maps[m], thr);
    // As the kernel builds it: one sorted threshold per node.
    int seen[kQuantCodes] = {};
    for (int i = 0; i + 1 < kQuantCodes; ++i) {
      const int k = quant8_eytzinger_node(i);
      EXPECT(k >= 1 && k < kQuantCodes, "node %d of %d", k, i);
      if (k >= 1 && k < kQuantCodes) {
        ++seen[k];
        eyt[k] = thr[i];
      }
    }
    for (int k = 1; k < kQuantCodes; ++k) EXPECT(seen[k] == 1, "node %d taken %d times", k, seen[k]);
    eyt[0] = INFINITY;
    // Every decision path: the outcomes b7..b0 of the 8 comparisons. quant8_encode (sorted)
    // compares with thr[c + span - 1] and adds span on "greater"; the Eytzinger search compares
    // with eyt[k] and goes to 2k + outcome. Same value at every step of every path => same code
    // for every float32.
    for (int path = 0; path < kQuantCodes; ++path) {
      int c = 0, k = 1;
      for (int l = 0; l < 8; ++l) {
        const int span = 128 >> l, go = (path >> (7 - l)) & 1;
        EXPECT(f32_bits(thr[c + span - 1]) == f32_bits(eyt[k]), "map %d path %d step %d", m, path, l);
        c += go ? span : 0;
        k = 2 * k + go;
      }
      EXPECT(c == path && k - kQuantCodes == path, "map %d path %d: %d %d", m, path, c, k);
    }
    // The functions themselves.
    for (int i = 0; i < kQuantCodes; ++i)
      for (const float p : {thr[i], maps[m][i]})
        for (int d = -2; d <= 2; ++d) check_value(thr, eyt, uint32_t(int64_t(f32_bits(p)) + d));
    for (uint32_t bin = 0; bin < 65536u; ++bin) {
      check_value(thr, eyt, bin << 16);
      check_value(thr, eyt, (bin << 16) | 0xFFFFu);
    }
    std::mt19937 rng(12345 + m);
    for (int r = 0; r < 4000000; ++r) check_value(thr, eyt, uint32_t(rng()));
    if (exhaustive) {
      long bad = 0;
#pragma omp parallel for reduction(+ : bad)
      for (int64_t u = 0; u < (int64_t(1) << 32); ++u) {
        const float x = bits_f32(uint32_t(u));
        bad += quant8_encode(thr, x) != quant8_encode_eytzinger(eyt, x);
      }
      EXPECT(bad == 0, "map %d: %ld of 2^32 float32 encode differently", m, bad);
      std::printf("map %d: all 2^32 float32 checked\n", m);
    }
    for (int k = 0; k < kQuantCodes; ++k) std::printf("%08x%c", f32_bits(eyt[k]), k % 16 == 15 ? '\n' : ' ');
  }
  if (failures) {
    std::printf("%ld failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
"""


@pytest.fixture(scope="module")
def eytzinger_layout(tmp_path_factory):
    """Runs the C++ check; returns the Eytzinger arrays quant8_math.h builds for both maps."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("eytzinger")
    maps = tmp / "maps.bin"
    maps.write_bytes(struct.pack("<512f", *(qm.signed_map().tolist() + qm.unsigned_map().tolist())))
    src, exe = tmp / "eytzinger.cpp", tmp / "eytzinger"
    src.write_text(PROGRAM)
    build = subprocess.run([CXX, "-std=c++17", "-O2", "-ffp-contract=off", "-fopenmp", "-I",
                            str(ROOT / "csrc" / "include"), str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    exhaustive = os.environ.get("MPFUSED_EXHAUSTIVE_ENCODE", "0")
    run = subprocess.run([str(exe), str(maps), exhaustive], capture_output=True, text=True,
                         timeout=3600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr
    words = [int(w, 16) for line in run.stdout.splitlines()
             if len(line.split()) == 16 for w in line.split()]
    assert len(words) == 512
    return [np.array(words[256 * m: 256 * (m + 1)], dtype=np.uint32).view(np.float32)
            for m in range(2)]


def test_eytzinger_encode_gives_the_same_codes(eytzinger_layout):
    for eyt, qmap in zip(eytzinger_layout, (qm.signed_map(), qm.unsigned_map())):
        assert np.isinf(eyt[0])
        assert sorted(eyt[1:].tolist()) == qm.thresholds(qmap)[:-1].tolist()


def _wavefronts(addr: np.ndarray) -> np.ndarray:
    """Shared-memory wavefronts of warp-wide 4-byte loads: addr [..., 32] float indices (bank =
    index mod 32, the arrays start at bank 0); per load, the most distinct addresses in one
    bank (equal addresses are one broadcast)."""
    a = np.sort(addr.reshape(-1, 32), axis=1)
    distinct = np.ones_like(a, dtype=bool)
    distinct[:, 1:] = a[:, 1:] != a[:, :-1]
    counts = np.zeros((a.shape[0], 32), dtype=np.int64)
    rows = np.repeat(np.arange(a.shape[0]), 32)
    np.add.at(counts, (rows, (a % 32).ravel()), distinct.ravel().astype(np.int64))
    return counts.max(axis=1).reshape(addr.shape[:-1])


def _search_addresses(x: np.ndarray, thr: np.ndarray, eyt: np.ndarray | None):
    """Indices read at each of the 8 steps (quant8_encode over sorted `thr`, or
    quant8_encode_eytzinger over `eyt`) and the codes."""
    out = []
    if eyt is None:
        c = np.zeros(x.shape, np.int64)
        for lvl in range(8):
            span = 128 >> lvl
            piv = c + span - 1
            out.append(piv)
            c = c + np.where(x > thr[piv], span, 0)
        return np.stack(out, -2), c
    k = np.ones(x.shape, np.int64)
    for _ in range(8):
        out.append(k.copy())
        k = 2 * k + (x > eyt[k])
    return np.stack(out, -2), k - 256


def _kernel_searches(signed: bool, rng) -> np.ndarray:
    """Adam-like normalized moments of one 4096-element chunk (16 quantization blocks of 256),
    arranged as the kernel's warps search them: [pass k, warp w, element j, lane] with
    e = 2048 k + 4 (32 w + lane) + j."""
    g = rng.standard_normal(4096).astype(np.float32) * 1e-3
    s = g * (0.1 + rng.random(4096)) if signed else g * g * rng.gamma(2.0, 1.0, 4096)
    blocks = s.astype(np.float32).reshape(16, 256)
    x = (blocks / np.abs(blocks).max(axis=1, keepdims=True)).astype(np.float32).ravel()
    k, w, j, lane = np.meshgrid(np.arange(2), np.arange(16), np.arange(4), np.arange(32),
                                indexing="ij")
    return x[2048 * k + 4 * (32 * w + lane) + j]


@pytest.mark.parametrize("signed", [True, False])
def test_eytzinger_search_bank_conflicts(eytzinger_layout, signed):
    """Wavefronts per warp-wide 8-step search with the real maps: <= 11 for the layout the kernel
    builds (8 would be conflict-free); the sorted layout it replaced needs ~31."""
    rng = np.random.default_rng(0)
    thr = qm.thresholds(qm.create_dynamic_map(signed=signed)).numpy()
    eyt = eytzinger_layout[0 if signed else 1]
    x = np.stack([_kernel_searches(signed, rng) for _ in range(20)])  # [..., lane]
    addr_e, code_e = _search_addresses(x, thr, eyt)  # [..., step, lane]
    addr_s, code_s = _search_addresses(x, thr, None)
    assert np.array_equal(code_e, code_s)
    per_search_e = _wavefronts(addr_e).sum(axis=-1).mean()
    per_search_s = _wavefronts(addr_s).sum(axis=-1).mean()
    print(f"wavefronts per warp-wide search: eytzinger {per_search_e:.2f}, "
          f"sorted {per_search_s:.2f}")
    assert per_search_e <= 11.0, per_search_e
    assert per_search_s >= 25.0, per_search_s  # the simulation sees the conflicts it removes
