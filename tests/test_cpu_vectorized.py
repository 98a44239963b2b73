"""The AVX2 (x86-64-v3) and baseline clones of the CPU elementwise kernels are vectorized, and the
8-bit / 4-bit kernels vectorize master_weights="remainder8" as wide as "remainder".

This machine (and CI's) runs the AVX-512 clone, so a clone that silently falls back to scalar code
shows in no timing here, only on users' AVX2-only CPUs. GCC's default -ftrapping-math did exactly
that to 34 of the 42 AVX2 clones (Adam fp32 2.6 ns/elem instead of 1.0 on one AVX2 core): setup.py
builds with -fno-trapping-math, and this test reads the built library's machine code to pin it.
"""
import re
import shutil
import subprocess

import pytest

from mpfused import _extension
from tests.conftest import skip_or_fail

# packed-single arithmetic on 256-bit registers (AVX2 clone) / on 128-bit registers (baseline)
_YMM_PACKED = re.compile(r"\bv(?:add|sub|mul|div|sqrt|max|min)ps\s+[^\n]*%ymm")
_XMM_PACKED = re.compile(r"\b(?:add|sub|mul|div|sqrt|max|min)ps\s")
_CLONE = re.compile(r"([0-9a-f]+) ([0-9a-f]+) [tT] (.*elementwise_chunk.*) "
                    r"\[clone \.(arch_x86_64_v3|default)\]$")


def _clones(so: str):
    nm = subprocess.run(["nm", "-S", "-C", so], capture_output=True, text=True, check=True).stdout
    for line in nm.splitlines():
        m = _CLONE.match(line)
        if m:
            yield int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4)


def test_avx2_and_baseline_clones_are_vectorized():
    module = _extension.load()
    if module is None:
        skip_or_fail(f"native extension not loaded: {_extension.error()}")
    if not (shutil.which("nm") and shutil.which("objdump")):
        skip_or_fail("binutils (nm, objdump) not installed")
    so = module.__file__
    clones = list(_clones(so))
    if not clones:
        pytest.skip("no x86-64 target_clones in this build (not an x86-64 Linux build)")
    scalar = []
    for addr, size, name, clone in clones:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={addr}",
                              f"--stop-address={addr + size}", so],
                             capture_output=True, text=True, check=True).stdout
        packed = _YMM_PACKED if clone == "arch_x86_64_v3" else _XMM_PACKED
        if not packed.search(asm):
            scalar.append(f"{clone}: {name[:140]}")
    assert len(clones) >= 20, f"expected the Adam/SGD/Lion chunk clones, found {len(clones)}"
    assert not scalar, "scalar (not vectorized) kernel clones:\n" + "\n".join(scalar)


# The per-ISA builds of the block-wise kernels (8-bit/4-bit Adam: chunk_*, SGD8bit/Lion8bit:
# state8_*) for bf16 params, named by master mode: 2 = remainder, 4 = remainder8.
_STATE8 = re.compile(r"([0-9a-f]+) ([0-9a-f]+) [tT] .*::((?:chunk|state8)_(?:v3|v4|vbmi)<.*"
                     r"bf16_t, )([24])([,>].*)$")
_PACKED_WIDTH = re.compile(r"\tv(?:add|sub|mul|div|sqrt|max|min)ps\s[^\n]*%(xmm|ymm|zmm)\d+\s*$",
                           re.M)


def test_remainder8_kernels_vectorize_as_wide_as_remainder():
    """An int8 operand in the hot loop made GCC vectorize it 4 floats at a time (xmm): the
    remainder8 builds had ~160 packed-single operations on xmm where the remainder builds have
    none and 8-16 lanes (1.7-1.8x the step time). The corrections are staged through int16 tiles
    (remainder8_join_wide); this pins that each remainder8 build has no more 4-lane arithmetic
    than its remainder build."""
    module = _extension.load()
    if module is None:
        skip_or_fail(f"native extension not loaded: {_extension.error()}")
    if not (shutil.which("nm") and shutil.which("objdump")):
        skip_or_fail("binutils (nm, objdump) not installed")
    so = module.__file__
    nm = subprocess.run(["nm", "-S", "-C", so], capture_output=True, text=True, check=True).stdout
    widths = {}
    for line in nm.splitlines():
        m = _STATE8.match(line)
        if not m:
            continue
        addr, size = int(m.group(1), 16), int(m.group(2), 16)
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={addr}",
                              f"--stop-address={addr + size}", so],
                             capture_output=True, text=True, check=True).stdout
        counts = {"xmm": 0, "ymm": 0, "zmm": 0}
        for w in _PACKED_WIDTH.findall(asm):
            counts[w] += 1
        widths[(m.group(3) + "{}" + m.group(5), int(m.group(4)))] = counts
    pairs = [(name, widths[(name, 2)], widths[(name, 4)]) for name, mode in widths
             if mode == 4 and (name, 2) in widths]
    if not pairs:
        pytest.skip("no per-ISA 8-bit builds in this build (not an x86-64 Linux GCC build)")
    assert len(pairs) >= 12, f"expected the Adam/SGD/Lion 8-bit v3/v4/vbmi builds, found {len(pairs)}"
    narrow = [f"{name.format('2/4')[:120]}: remainder {r2}, remainder8 {r8}"
              for name, r2, r8 in pairs
              if r8["xmm"] > r2["xmm"] + 8 or r8["ymm"] + r8["zmm"] < (r2["ymm"] + r2["zmm"]) // 2]
    assert not narrow, ("remainder8 builds vectorized narrower than remainder (packed-single "
                        "arithmetic per register width):\n" + "\n".join(narrow))
