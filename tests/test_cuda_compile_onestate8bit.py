"""nvcc checks of the one-state CUDA kernels (csrc/cuda/sgd8bit_cuda.cu, lion8bit_cuda.cu on
one_state8bit_cuda.cuh: sgd8bit_step_ / lion8bit_step_ and, specialized on the code width,
sgd4bit_step_ / lion4bit_step_), per specialization: with setup.py's flags, for sm_80 (the 4 KB
kernel-parameter launches) and sm_90 (32 KB), every main-kernel entry (policy x master mode x
code width) exists, stays within 64 registers (the two blocks per SM its functor asks for) with
no spill and the 18,864 B of static shared memory its layout has; the prepare entries (one per
policy, width and step-table size) stay small; the sm_90 PTX has no contracted or approximate
f32 math (setup.py's flags) and the main kernels' none of fp64 work or calls (the per-step fp64
setup is the prepare launch's). tests/test_cuda_compile.py checks every other .cu file (this
file's two are left to this module: compiled once).

ptxas 13.0 figures (registers; 0 B spill everywhere), master modes none / fp32 / remainder /
stochastic / remainder8, 8-bit | 4-bit codes:
    sm_90  sgd 59/64/64/61/64 | 56/62/62/60/62  sgd nesterov 60/64/64/61/64 | 56/62/63/60/62
           lion 60/64/64/64/64 | 58/63/63/64/63  prepare 30
    sm_80  sgd 58/64/64/61/64 | 56/63/63/60/62  sgd nesterov 60/64/64/61/64 | 56/63/63/60/64
           lion 60/64/63/62/64 | 60/64/63/64/63  prepare 30
"""
from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import deadline_s, skip_or_fail
from tests.cuda_compile_common import (CU_FILES, NEEDS_NVCC, NVCC, ROOT, SETUP_NVCC_FLAGS,
                                       _inexact_f32, _ptx_entries, _ptxas_report, _smem)

UNITS = ["sgd8bit_cuda", "lion8bit_cuda"]
ARCHS = ["sm_80", "sm_90"]
MODES = ["none", "fp32", "remainder", "stochastic", "remainder8"]  # MasterMode 0..4
POLICIES = {"sgd8bit_cuda": ["sgd", "sgd_nesterov"], "lion8bit_cuda": ["lion"]}
WIDTHS = [8, 4]  # code bits: sgd8bit_step_ / lion8bit_step_, sgd4bit_step_ / lion4bit_step_
MAIN_REGISTERS = 64  # OneState8bitFunctor::kMinBlocksPerSm = 2 with 512 threads
PREPARE_REGISTERS = 40
SMEM_BYTES = 18864   # OneStateShared: 16 KB parked states, map, thresholds, reduction, scalars
DEADLINE_S = deadline_s(240.0)

pytestmark = NEEDS_NVCC


def _main_key(name: str) -> str | None:
    """'sgd_nesterov/fp32/4' for a main-kernel entry (mangled name: policy, master mode, code
    bits), None for others."""
    m = re.search(r"OneState8bitFunctor.*?(Sgd8bitPolicyILb([01])E|Lion8bitPolicy)E*Li(\d)ELi(\d)E",
                  name)
    if not m:
        return None
    policy = "lion" if m.group(1).startswith("Lion") else (
        "sgd_nesterov" if m.group(2) == "1" else "sgd")
    return f"{policy}/{MODES[int(m.group(3))]}/{m.group(4)}"


def _build(job) -> dict:
    """(unit, arch) -> (rc, ptxas -v output, its -keep dir); rc None: cut by the module deadline.
    In the background from collection on (tests/background_builds.py)."""
    tmp = Path(job.tmp)

    def build(unit: str, arch: str):
        keep = tmp / f"keep_{unit}_{arch}"
        keep.mkdir()
        small = ["-DMPF_CUDA_SMALL_KERNEL_PARAMS"] if arch == "sm_80" else []
        cmd = [NVCC, "-c", *SETUP_NVCC_FLAGS, "-keep", "-keep-dir", str(keep), *small, "-Xptxas",
               "-v", f"-arch={arch}", "-I", str(ROOT / "csrc" / "include"),
               str(ROOT / "csrc" / "cuda" / f"{unit}.cu"), "-o", str(tmp / f"{unit}.{arch}.o")]
        return (*job.run(cmd), keep)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(UNITS) * len(ARCHS)) as ex:
        futs = {(u, a): ex.submit(build, u, a) for u in UNITS for a in ARCHS}
        return {k: f.result() for k, f in futs.items()}


BACKGROUND_BUILD = _build if NVCC is not None else None


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return background_builds.result(__name__, _build, DEADLINE_S, tmp_path_factory)


def _out(builds, unit, arch) -> tuple[str, Path]:
    rc, out, keep = builds[(unit, arch)]
    if rc is None:
        skip_or_fail(out)
    assert rc == 0, out
    return out, keep


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unit", UNITS)
def test_every_specialization_within_budget(builds, unit, arch):
    out, _ = _out(builds, unit, arch)
    kernels = _ptxas_report(out)
    smem = _smem(out)
    main = {_main_key(n): (n, r) for n, r in kernels.items() if _main_key(n)}
    expected = {f"{p}/{m}/{b}" for p in POLICIES[unit] for m in MODES for b in WIDTHS}
    assert set(main) == expected, sorted(main)
    for key, (name, r) in main.items():
        assert 0 < r["registers"] <= MAIN_REGISTERS, (key, r)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (key, r)
        assert smem.get(name) == SMEM_BYTES, (key, smem.get(name))
    prepare = {n: r for n, r in kernels.items() if "prepare_kernel" in n}
    # Per policy and width: sm_80 builds the 4 KB step table only; sm_90 also the 32 KB one
    # (CUDA >= 12.1).
    tables = {1} if arch == "sm_80" else {1, 2}
    for bits in WIDTHS:
        mine = [n for n in prepare if re.search(rf"OneStatePrepare.*ELi{bits}EEE", n)]
        assert len(mine) in {len(POLICIES[unit]) * k for k in tables}, (bits, sorted(prepare))
    assert len(prepare) in {len(POLICIES[unit]) * len(WIDTHS) * k for k in tables}, sorted(prepare)
    for name, r in prepare.items():
        assert 0 < r["registers"] <= PREPARE_REGISTERS and r["spill_stores"] == 0, (name, r)


@pytest.mark.parametrize("unit", UNITS)
def test_main_kernels_do_no_fp64_work(builds, unit):
    """The blocks only copy what the prepare launch computed (sgd/lion scalars, thresholds)."""
    _, keep = _out(builds, unit, "sm_90")
    ptx = (keep / f"{unit}.ptx").read_text()
    main = {n: e for n, e in _ptx_entries(ptx).items() if "OneState8bitFunctor" in n}
    assert len(main) == len(MODES) * len(POLICIES[unit]) * len(WIDTHS), sorted(main)
    for name, text in main.items():
        assert re.findall(r"\b[a-z][a-z0-9.]*\.f64\b", text) == [], name
        assert not re.search(r"\bcall(\.uni)?\b", text), name


@pytest.mark.parametrize("unit", UNITS)
def test_ptx_has_exact_math_only(builds, unit):
    _, keep = _out(builds, unit, "sm_90")
    ptx = (keep / f"{unit}.ptx").read_text()
    assert ".entry" in ptx and _inexact_f32(ptx) == [], unit


def test_every_cuda_file_is_checked_by_one_module():
    every = {Path(f).name for f in (ROOT / "csrc" / "cuda").glob("*.cu")}
    theirs = {Path(f).name for f in CU_FILES}
    assert every == theirs | {f"{u}.cu" for u in UNITS} and not theirs & {f"{u}.cu" for u in UNITS}
