"""The AVX2 (x86-64-v3) and baseline clones of the CPU elementwise kernels are vectorized.

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
