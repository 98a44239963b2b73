"""Standalone build checks of the CUDA kernels that need no GPU, only nvcc on PATH:

* every csrc/cuda/*.cu compiles with `nvcc -c -std=c++17 -arch=sm_80` and `-arch=sm_90` (the
  kernels are torch-free, include path csrc/include only), sm_80 with the 4 KB kernel-parameter
  launches of toolkits < 12.1, sm_90 with the 32 KB ones, with setup.py's flags;
* every kernel entry stays within its file's register, spill (and, for the 8-bit Adam kernel,
  shared memory) budget (ptxas -v);
* setup.py's flags keep the math exact, and the kernels' PTX has no contracted or approximate
  f32 math (the check's own probes show it can fail).

Elsewhere: the one-state 8/4-bit kernels (tests/test_cuda_compile_onestate8bit.py), the
multi-tensor packing run on the host (test_cuda_mta_packing.py), the CUDA bindings against torch's
headers (test_cuda_bindings_syntax.py); what they share is tests/cuda_compile_common.py. All jobs
run in parallel, once per module, in the background from collection on
(tests/background_builds.py), under one deadline (counted from when this module's tests start) so
the module stays < 2 minutes; a job cut by that deadline (an overloaded machine) is skipped, not
failed (failed under MPFUSED_STRICT_TESTS=1).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import deadline_s, skip_or_fail
from tests.cuda_compile_common import (ARCHS, BINDINGS, CU_FILES, NEEDS_NVCC, NVCC, ROOT,
                                       SETUP_NVCC_FLAGS, TIMEOUT, _check, _inexact_f32,
                                       _ptx_entries, _ptxas_report, _smem, run_jobs)

DEADLINE_S = deadline_s(110.0)

pytestmark = NEEDS_NVCC


def _setup_cxx_flags() -> list[str]:
    """The string literals of setup.py's `cxx = [...]` host flag list."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "cxx"
                and isinstance(node.value, ast.List)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    raise AssertionError("setup.py has no `cxx = [...]` flag list")


def _setup_exact_math_guard():
    """setup.py's _check_exact_math (with its regexes), without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name == "_check_exact_math")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "").startswith("_INEXACT")
                                                   for t in n.targets))]
    ns = {"re": re, "os": os}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    return ns["_check_exact_math"]


def _build(job) -> dict:
    """Every compile job, in parallel (in the background from collection on:
    tests/background_builds.py). name -> (rc, output); rc TIMEOUT: cut by the module deadline."""
    tmp = Path(job.tmp)
    jobs: dict[str, list[list[str]]] = {}
    for cu in CU_FILES:
        for arch in ARCHS:
            out = tmp / f"{Path(cu).stem}.{arch}.o"
            # sm_90 keeps its PTX (test_ptx_has_exact_math_only)
            keep = ["-keep", "-keep-dir", str(tmp / f"keep_{Path(cu).stem}")] if arch == "sm_90" else []
            if keep:
                Path(keep[2]).mkdir()
            # nvcc >= 13 builds the 32 KB kernel-parameter launches only: sm_80 compiles the
            # 4 KB ones (toolkits < 12.1) so both stay compiled and within the budgets.
            small = ["-DMPF_CUDA_SMALL_KERNEL_PARAMS"] if arch == "sm_80" else []
            jobs[f"{Path(cu).name}:{arch}"] = [[NVCC, "-c", *SETUP_NVCC_FLAGS, *keep, *small, "-Xptxas",
                                                "-v", f"-arch={arch}", "-I",
                                                str(ROOT / "csrc" / "include"), cu, "-o", str(out)]]
    # The PTX check's own check: a contractible a * b + c and a division, with setup.py's flags,
    # with --fmad=true and with --use_fast_math; and platform.h refusing the host's -ffast-math.
    probe = tmp / "fma_probe.cu"
    probe.write_text('#include "mpfused/platform.h"\n__global__ void k(float* x, float a, float b) '
                     '{ x[0] = x[0] * a + b; x[1] = x[1] / a; }\n')
    for name, flags in [("setup", SETUP_NVCC_FLAGS),
                        ("fmad_true", [f for f in SETUP_NVCC_FLAGS if f != "--fmad=false"]
                         + ["--fmad=true"]),
                        ("fast_math", [*SETUP_NVCC_FLAGS, "--use_fast_math"])]:
        jobs[f"probe:{name}"] = [[NVCC, "-ptx", *flags, "-arch=sm_90", "-I",
                                  str(ROOT / "csrc" / "include"), str(probe), "-o",
                                  str(tmp / f"{name}.ptx")], ["cat", str(tmp / f"{name}.ptx")]]
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx:
        host = tmp / "fast_math_host.cpp"
        host.write_text('#include "mpfused/platform.h"\n')
        jobs["probe:host_fast_math"] = [[cxx, "-std=c++17", "-fsyntax-only", "-ffast-math", "-I",
                                         str(ROOT / "csrc" / "include"), str(host)]]
    res = run_jobs(job, jobs)
    res["_tmp"] = str(tmp)
    return res


BACKGROUND_BUILD = _build if NVCC is not None else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return background_builds.result(__name__, _build, DEADLINE_S, tmp_path_factory)


def test_there_are_cuda_sources():
    names = {Path(f).name for f in CU_FILES}
    assert {"amp_cuda.cu", "adam_cuda.cu", "adam8bit_cuda.cu", "sgd_cuda.cu", "lion_cuda.cu",
            "step_counters_cuda.cu"} <= names
    bindings = {Path(b).name for b in BINDINGS}
    assert {"amp_ops_cuda.cpp", "adam_ops_cuda.cpp", "adam8bit_ops_cuda.cpp"} <= bindings
    assert (ROOT / "csrc" / "cuda" / "multi_tensor_apply.cuh").exists()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", [Path(f).name for f in CU_FILES])
def test_cu_compiles(results, cu, arch):
    _check(results[f"{cu}:{arch}"])


# Register and spill budgets per file (512-thread blocks; 65536 registers per SM). The 8-bit,
# Adam and elementwise (SGD, Lion) kernels ask for two blocks per SM (<= 64 registers); the 8-bit
# Adam kernel's 8-bit codes pay 8 B of spill for it in the fp32-master and remainder8 modes (16 B,
# and 8 B in the remainder mode, before its per-block setup moved to the prepare launch:
# adam8bit_prepare.cuh, 38-40 registers); its 4-bit codes spill nothing
# (test_adam8bit_every_width_and_mode_within_budget). The others spill nothing: AMSGrad with the
# int8 master correction (master mode 4), the widest Adam specialization, spilled 12 B at 3
# elements in flight in the scalar loop and keeps 2 (adam_cuda.cu's ilp).
RESOURCE_BUDGET = {"adam8bit_cuda.cu": {"registers": 64, "spill_stores": 8},
                   "adam_cuda.cu": {"registers": 64, "spill_stores": 0},
                   "amp_cuda.cu": {"registers": 128, "spill_stores": 0},
                   "lion_cuda.cu": {"registers": 64, "spill_stores": 0},
                   "sgd_cuda.cu": {"registers": 64, "spill_stores": 0},
                   "step_counters_cuda.cu": {"registers": 32, "spill_stores": 0}}

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", [Path(f).name for f in CU_FILES])
def test_cu_register_budget(results, cu, arch):
    """Built with setup.py's flags, every kernel entry stays within its file's register and
    spill budget, so the occupancy the kernels' comments assume is the one ptxas gives."""
    kernels = _ptxas_report(_check(results[f"{cu}:{arch}"]))
    assert kernels, "ptxas -v reported no kernel entries"
    budget = RESOURCE_BUDGET[cu]
    for name, r in kernels.items():
        assert 0 < r["registers"] <= budget["registers"], (name, r)
        assert r["spill_stores"] <= budget["spill_stores"], (name, r)


ADAM8BIT_MODES = ["none", "fp32", "remainder", "stochastic", "remainder8"]  # MasterMode 0..4
ADAM8BIT_SMEM = 37696  # q8::Shared: 32 KB of parked moments, maps, thresholds, reduction, scalars
# ptxas 13.0 (setup.py's flags), registers / spill-store bytes per master mode 0..4:
#   sm_90  8-bit 62/0 64/8 64/0 64/0 64/8   4-bit 56/0 62/0 62/0 56/0 62/0   prepare 38/0
#   sm_80  8-bit 62/0 64/8 64/0 64/0 64/8   4-bit 56/0 62/0 62/0 60/0 62/0   prepare 38/0


@pytest.mark.parametrize("arch", ARCHS)
def test_adam8bit_every_width_and_mode_within_budget(results, arch):
    """The 8-bit Adam kernel's specializations, code width (8 | 4, adam8bit_step_ /
    adam4bit_step_) x master mode: every one exists, within 64 registers (two 512-thread blocks
    per SM) and its static shared memory; 4-bit codes with no spill, 8-bit ones within the file's
    8 B; the prepare launches (one per width and step-table size) small and spill-free."""
    out = _check(results[f"adam8bit_cuda.cu:{arch}"])
    kernels, smem = _ptxas_report(out), _smem(out)
    main = {}
    for name, r in kernels.items():
        m = re.search(r"Adam8bitFunctorILi(\d)ELi(\d)E", name)
        if m:
            main[(int(m.group(2)), ADAM8BIT_MODES[int(m.group(1))])] = (name, r)
    assert set(main) == {(b, m) for b in (8, 4) for m in ADAM8BIT_MODES}, sorted(main)
    for (bits, mode), (name, r) in main.items():
        assert 0 < r["registers"] <= 64, (bits, mode, r)
        spill = 0 if bits == 4 else RESOURCE_BUDGET["adam8bit_cuda.cu"]["spill_stores"]
        assert r["spill_stores"] <= spill, (bits, mode, r)
        assert smem.get(name) == ADAM8BIT_SMEM, (bits, mode, smem.get(name))
    prepare = {n: r for n, r in kernels.items() if "prepare_kernel" in n}
    per_width = {1} if arch == "sm_80" else {1, 2}  # the 4 KB step table; sm_90 also 32 KB
    for bits in (8, 4):
        mine = {n: r for n, r in prepare.items() if f"AdamPrepareILi{bits}E" in n}
        assert len(mine) in per_width, sorted(prepare)
        for name, r in mine.items():
            assert 0 < r["registers"] <= 40 and r["spill_stores"] == 0, (name, r)


def test_setup_flags_keep_math_exact():
    """setup.py's flags keep IEEE math (no fast math, no contraction), and its guard refuses
    every flag that would not: the build fails instead of shipping kernels that differ from the
    CPU ones."""
    guard = _setup_exact_math_guard()
    cxx = _setup_cxx_flags()
    assert "--fmad=false" in SETUP_NVCC_FLAGS and "-ffp-contract=off" in cxx
    assert guard(SETUP_NVCC_FLAGS, cxx, env={}) is None
    assert guard([], cxx, env={}) is None  # CPU-only build
    for bad in (["--use_fast_math"], ["-use_fast_math"], ["--fmad=true"], ["-fmad=true"],
                ["--ftz=true"], ["--prec-div=false"], ["--prec-sqrt=false"]):
        assert guard([*SETUP_NVCC_FLAGS, *bad], cxx, env={}), bad
    assert guard([f for f in SETUP_NVCC_FLAGS if f != "--fmad=false"], cxx, env={})
    assert guard(SETUP_NVCC_FLAGS, cxx, env={"NVCC_APPEND_FLAGS": "-O3 --use_fast_math"})
    assert guard(SETUP_NVCC_FLAGS, cxx, env={"NVCC_PREPEND_FLAGS": "--fmad=true"})
    for bad in ("-ffast-math", "-Ofast", "-ffp-contract=fast", "-ffp-contract=on"):
        assert guard(SETUP_NVCC_FLAGS, [*cxx, bad], env={}), bad
    assert guard(SETUP_NVCC_FLAGS, [f for f in cxx if f != "-ffp-contract=off"], env={})


@pytest.mark.parametrize("cu", [Path(f).name for f in CU_FILES])
def test_ptx_has_exact_math_only(results, cu):
    """The kernels' PTX (setup.py's flags, sm_90) has no contracted or approximate f32 math."""
    _check(results[f"{cu}:sm_90"])
    ptx = (Path(results["_tmp"]) / f"keep_{Path(cu).stem}" / f"{Path(cu).stem}.ptx").read_text()
    assert ".entry" in ptx
    assert _inexact_f32(ptx) == [], cu


def test_adam8bit_blocks_do_no_fp64_work(results):
    """The 8-bit kernel's blocks do no fp64 work and call no subroutine: the bias corrections'
    pow and the encode thresholds are computed once per call by the prepare kernel
    (adam8bit_prepare.cuh), whose results every block only copies (sm_90 PTX, setup.py's flags)."""
    _check(results["adam8bit_cuda.cu:sm_90"])
    ptx = (Path(results["_tmp"]) / "keep_adam8bit_cuda" / "adam8bit_cuda.ptx").read_text()
    entries = _ptx_entries(ptx)
    main = {n: e for n, e in entries.items() if "Adam8bitFunctor" in n}
    # master modes x code widths
    assert len(main) == 10 and any("prepare_kernel" in n for n in entries), sorted(entries)
    for name, text in main.items():
        assert re.findall(r"\b[a-z][a-z0-9.]*\.f64\b", text) == [], name
        assert not re.search(r"\bcall(\.uni)?\b", text), name


def test_exact_math_checks_can_fail(results):
    """The PTX check sees contraction and fast math when they are on; platform.h refuses the
    host's -ffast-math."""
    assert _inexact_f32(_check(results["probe:setup"])) == []
    assert "fma.rn.f32" in _inexact_f32(_check(results["probe:fmad_true"]))
    assert any(".approx." in t or ".ftz." in t
               for t in _inexact_f32(_check(results["probe:fast_math"])))
    if "probe:host_fast_math" in results:
        rc, out = results["probe:host_fast_math"]
        if rc is TIMEOUT:
            skip_or_fail(out)
        assert rc != 0 and "-ffast-math breaks the bit-exact" in out, out
