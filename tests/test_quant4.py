"""The 4-bit codec (mpfused/quant4.py, quant8_math.h "4-bit codes"): maps byte-equal to torchao's,
nearest-code encoding in pure torch and in the C++ header (every encoder, against a float64
brute force), nibble packing in torchao's order, exact round trips, error bounds, no zero
collapse of the second moment, NaN / inf rules.

Bounds (absmax-relative, the maps' largest half-gaps): signed map 0.1125 (its widest gaps, 0.225,
between 0.2125 and 0.4375 and between 0.6625 and 0.8875, both signs); unsigned map 1/32 above 1/16
and 1/16 below it (no zero: a value in [0, 1/32) encodes as 1/16)."""
import math
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from mpfused import quant4 as q4
from mpfused import quant_maps as qm

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")
MAPS = {"signed": q4.signed4_map(), "unsigned": q4.unsigned4_map()}
HALF_GAP = {"signed": 0.1125, "unsigned": 1 / 16}


@pytest.mark.parametrize("signed", [True, False])
def test_maps_byte_equal_to_torchao(signed):
    sub = pytest.importorskip("torchao.optim.subclass_4bit")
    theirs = torch.tensor(sub.get_qmap_signed() if signed else sub.get_qmap_unsigned(),
                          dtype=torch.float32)
    ours = q4.signed4_map() if signed else q4.unsigned4_map()
    assert ours.numpy().tobytes() == theirs.numpy().tobytes()


def test_map_properties():
    s, u = MAPS["signed"], MAPS["unsigned"]
    for m in (s, u):
        assert m.numel() == 16 and bool((m[1:] > m[:-1]).all()) and m[-1].item() == 1.0
    assert s[q4.SIGNED4_ZERO_CODE].item() == 0.0 and qm.zero_code(s) == 7
    assert u.min().item() == 1 / 16 and qm.zero_code(u) == -1  # no zero entry
    assert s[6].item() == pytest.approx(-0.0055) and s[0].item() == pytest.approx(-0.8875)
    assert (s[1:] - s[:-1]).max().item() / 2 == pytest.approx(HALF_GAP["signed"])


def _brute_nearest(x, qmap):
    d = (x.double()[:, None] - qmap.double()[None, :]).abs()
    c = d.argmin(dim=1)  # first (lower) index on ties
    c = torch.where(x == math.inf, qmap.numel() - 1, c)
    c = torch.where(x == -math.inf, 0, c)
    return torch.where(torch.isnan(x), 0, c)


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_encode_is_nearest_code(name):
    qmap = MAPS[name]
    thr = qm.thresholds(qmap)[:-1]
    pts = torch.cat([thr, qmap])
    probes = torch.cat([pts, torch.nextafter(pts, torch.tensor(math.inf)),
                        torch.nextafter(pts, torch.tensor(-math.inf)),
                        ((qmap[:-1].double() + qmap[1:].double()) / 2).float(),
                        torch.tensor([0.0, -0.0, 1.0000001, -1.0000001, 2.0, -2.0, 1e-30,
                                      math.inf, -math.inf, math.nan]),
                        torch.randn(20000) * 0.3, torch.rand(20000) * 2 - 1])
    assert torch.equal(qm.encode(probes, qmap), _brute_nearest(probes, qmap))


def test_pack_order_is_torchaos():
    codes = torch.randint(0, 16, (1001,), dtype=torch.uint8)
    packed = q4.pack4(codes)
    assert packed.numel() == 501 and packed[-1].item() & 0xF == 0  # odd tail: low nibble 0
    assert torch.equal(packed[:500], (codes[:1000:2] << 4) | codes[1:1000:2])  # torchao's packing
    assert torch.equal(q4.unpack4(packed, 1001), codes.long())


@pytest.mark.parametrize("name", ["signed", "unsigned"])
@pytest.mark.parametrize("absmax", [1.0, 3.7e-3, 2.5e7, 1e-38])
def test_every_code_round_trips(name, absmax):
    """A block holding every entry times absmax (1.0 among them, so the block's absmax is it)
    decodes to exactly those values and re-encodes to the same codes."""
    qmap = MAPS[name]
    for block in (64, 128, 256):
        codes = torch.arange(block) % 16
        x = q4.dequantize4_blockwise(q4.pack4(codes), torch.tensor([absmax]), qmap, block,
                                     (block,))
        assert torch.equal(x, qmap[codes] * torch.tensor(absmax))
        packed, am = q4.quantize4_blockwise(x, qmap, block)
        assert am.item() == pytest.approx(absmax, rel=1e-7)
        assert torch.equal(q4.unpack4(packed, block), codes)


@pytest.mark.parametrize("name", ["signed", "unsigned"])
@pytest.mark.parametrize("block", [64, 128, 4096])
def test_block_error_bounded(name, block):
    g = torch.Generator().manual_seed(block)
    n = 3 * block + 17
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n).float()
    if name == "unsigned":
        x = x.abs()
    packed, absmax = q4.quantize4_blockwise(x, MAPS[name], block)
    y = q4.dequantize4_blockwise(packed, absmax, MAPS[name], block, (n,)).double()
    scale = absmax.double().repeat_interleave(block)[:n]
    err = (y - x.double()).abs() / scale
    assert err.max().item() <= HALF_GAP[name] * (1 + 1e-6)


def test_no_zero_collapse_of_v():
    """Tiny positive v next to a large one never decode to 0 (the zero-free map): they decode to
    absmax / 16, so the update m / sqrt(v) shrinks instead of exploding."""
    v = torch.full((256,), 1e-12)
    v[0], v[200] = 1.0, 3e-30
    packed, absmax = q4.quantize4_blockwise(v, MAPS["unsigned"], 128)
    y = q4.dequantize4_blockwise(packed, absmax, MAPS["unsigned"], 128, (256,))
    assert bool((y > 0).all())
    assert y[1].item() == 1 / 16 and y[200].item() == pytest.approx(3e-30 / 16 * 16, rel=1e-6)
    zero = torch.zeros(128)  # an all-zero block has absmax 0 and decodes to exact zeros
    p0, a0 = q4.quantize4_blockwise(zero, MAPS["unsigned"], 128)
    assert a0.item() == 0 and bool((q4.dequantize4_blockwise(p0, a0, MAPS["unsigned"], 128,
                                                             (128,)) == 0).all())


def test_nan_and_inf_rules():
    x = torch.ones(256) * 0.5
    x[3], x[130] = math.nan, math.inf
    packed, absmax = q4.quantize4_blockwise(x, MAPS["signed"], 128)
    assert math.isnan(absmax[0].item()) and absmax[1].item() == math.inf
    y = q4.dequantize4_blockwise(packed, absmax, MAPS["signed"], 128, (256,))
    assert bool(torch.isnan(y[:128]).all())  # a NaN moment poisons its block, never passes
    assert not bool(torch.isfinite(y[128:]).all())


PROGRAM = r"""
#include <cmath>
#include <cstdio>
#include <random>
#include "mpfused/quant8_math.h"
using namespace mpfused;
static long failures = 0;
static Quant8Lut lut;
static int brute(const float* map, float x) {
  if (std::isnan(x)) return 0;
  if (x >= map[kQuant4Codes - 1]) return kQuant4Codes - 1;  // differences below are exact
  if (x <= map[0]) return 0;
  int best = 0;
  for (int i = 1; i < kQuant4Codes; ++i)
    if (std::fabs(double(x) - map[i]) < std::fabs(double(x) - map[best])) best = i;
  return best;
}
static void check(const float* map, const float* thr, uint32_t u) {
  const float x = bits_f32(u);
  const int want = brute(map, x);
  const int a = quant4_encode(thr, x), b = quant8_encode(thr, x);
  const int c = int(quant8_encode_lut(lut.center(), x) & 0xFF);
  if ((a != want || b != want || c != want) && ++failures < 20)
    std::printf("FAIL %08x: brute %d quant4 %d quant8 %d lut %d\n", u, want, a, b, c);
}
int main(int argc, char** argv) {
  FILE* f = std::fopen(argv[1], "rb");
  float maps[2][kQuant4Codes];
  if (!f || std::fread(maps, sizeof maps, 1, f) != 1) return 2;
  for (int m = 0; m < 2; ++m) {
    float thr[kQuantCodes];
    quant8_thresholds(maps[m], thr, kQuant4Codes);
    quant8_build_lut(maps[m], lut, -1, kQuant4Codes);
    if (!lut.exact) { std::printf("lut not exact\n"); return 1; }
    for (int i = 0; i < kQuant4Codes; ++i) std::printf("%08x%c", f32_bits(thr[i]), i == 15 ? '\n' : ' ');
    for (int i = 0; i < kQuant4Codes; ++i)
      for (const float p : {thr[i], maps[m][i]})
        for (int d = -2; d <= 2; ++d) check(maps[m], thr, uint32_t(int64_t(f32_bits(p)) + d));
    for (uint32_t bin = 0; bin < 65536u; ++bin) {
      check(maps[m], thr, bin << 16);
      check(maps[m], thr, (bin << 16) | 0xFFFFu);
    }
    std::mt19937 rng(7 + m);
    for (int r = 0; r < 2000000; ++r) check(maps[m], thr, uint32_t(rng()));
  }
  uint8_t b[3] = {};  // packing: element 2k high nibble
  for (int i = 0; i < 5; ++i) {
    const int even = i, odd = 15 - i;
    b[0] = quant4_pack(even, odd);
    if (quant4_code_at(b, 0) != even || quant4_code_at(b, 1) != odd) ++failures;
  }
  std::printf(failures ? "%ld failures\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
"""


def test_header_encoders_are_nearest_code(tmp_path):
    """quant4_encode, quant8_encode over the padded thresholds and the CPU kernel's table encode
    (built for 16 codes) give the float64-nearest code on every bin edge of the float32 bit
    pattern, every neighbour of every threshold and entry and 2M random patterns; the header's
    thresholds are the Python codec's."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    maps = tmp_path / "maps.bin"
    maps.write_bytes(struct.pack("<32f", *(MAPS["signed"].tolist() + MAPS["unsigned"].tolist())))
    src, exe = tmp_path / "q4.cpp", tmp_path / "q4"
    src.write_text(PROGRAM)
    build = subprocess.run([CXX, "-std=c++17", "-O2", "-ffp-contract=off", "-I",
                            str(ROOT / "csrc" / "include"), str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), str(maps)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr
    lines = [line.split() for line in run.stdout.splitlines() if len(line.split()) == 16]
    for words, name in zip(lines, ("signed", "unsigned")):
        got = [struct.unpack("<f", struct.pack("<I", int(w, 16)))[0] for w in words]
        assert got == qm.thresholds(MAPS[name]).tolist()
