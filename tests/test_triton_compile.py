"""The Triton kernels compiled, not interpreted: every specialization the optimizers and the scaler
launch is compiled ahead of time for sm_80 and sm_90 by tests/triton_aot.py (no GPU needed:
Triton's own compiler and ptxas), then its PTX and ptxas' resource report are checked.

The rest of the suite runs these kernels under TRITON_INTERPRET=1, which never lowers them. What
only the compiler shows: a kernel that does not compile; FMA contraction, which changes
rounding (and turned the old `x*s - x*s != 0` non-finite test into the product's rounding error);
Triton's approximate division and square root; register spills.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import STRICT, deadline_s, skip_or_fail  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
DEADLINE_S = deadline_s(300.0)  # both archs in parallel take ~1 minute on 2 cores


def _has_nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ImportError:  # no triton at all
        return False


pytestmark = pytest.mark.skipif(not _has_nvidia_backend() and not STRICT,
                                reason="Triton's NVIDIA backend is not installed")


def _compile(job) -> dict:
    """{arch: the report's path, or the reason it failed; None: cut by the deadline}. Both archs
    in parallel, in the background from collection on (tests/background_builds.py). The report is
    read in the fixture: a background thread allocating many objects while another test runs
    would show in test_hardening's object count."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the checkout's mpfused, also where it is not pip-installed (the script runs as a file)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def run(arch):
        path = os.path.join(job.tmp, f"{arch}.json")
        rc, out = job.run([sys.executable, str(ROOT / "tests" / "triton_aot.py"), str(arch), path],
                          env)
        if rc is None:
            return None
        if rc != 0:
            return f"driver exit {rc}:\n{out[-3000:]}"
        return Path(path)

    with concurrent.futures.ThreadPoolExecutor(len(ARCHS)) as pool:
        futures = {a: pool.submit(run, a) for a in ARCHS}
        return {a: f.result() for a, f in futures.items()}


BACKGROUND_BUILD = _compile if _has_nvidia_backend() else None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{arch: the driver's report}, or the reason it failed."""
    res = background_builds.result(__name__, _compile, DEADLINE_S, tmp_path_factory)
    if any(r is None for r in res.values()):
        skip_or_fail(f"ahead-of-time compilation passed the {DEADLINE_S:.0f} s deadline "
                     "(an overloaded machine)")
    return {a: json.loads(r.read_text()) if isinstance(r, Path) else r for a, r in res.items()}


def _report(compiled, arch) -> dict:
    r = compiled[arch]
    assert isinstance(r, dict), r
    if "unsupported" in r:
        pytest.skip(f"Triton {r['triton']}: its internals differ ({r['unsupported']})")
    return r


def _kernels(report, name):
    return [k for k in report["kernels"] if k["kernel"] == name]


def _values(kernels, key):
    return {k["constexprs"].get(key, k["signature"].get(key)) for k in kernels}


# (param dtype code, kernel master mode) pairs the optimizers launch: fp32 params are their own
# master; fp16 params have an fp32 master or none; bf16 params an fp32 master, the remainder
# (2), the one-byte correction (4) or none, which for bf16 is stochastic rounding (3)
MODE_PAIRS = {(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (2, 3), (2, 4)}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles(compiled, arch):
    report = _report(compiled, arch)
    assert report["errors"] == []
    names = {k["kernel"] for k in report["kernels"]}
    assert names == {"_adam_kernel", "_adam8bit_kernel", "_sgd_kernel", "_lion_kernel",
                     "_sgd8bit_kernel", "_lion8bit_kernel", "_check_kernel",
                     "_update_scale_kernel"}


@pytest.mark.parametrize("arch", ARCHS)
def test_specializations_cover_the_options(compiled, arch):
    report = _report(compiled, arch)
    adam = _kernels(report, "_adam_kernel")
    q8 = _kernels(report, "_adam8bit_kernel")
    sgd = _kernels(report, "_sgd_kernel")
    lion = _kernels(report, "_lion_kernel")
    sgd8 = _kernels(report, "_sgd8bit_kernel")
    lion8 = _kernels(report, "_lion8bit_kernel")
    scalars = ("MAXIMIZE", "HAS_LR", "HAS_SCALE", "HAS_FOUND", "HAS_NORM")
    for ks, flags in ((adam, ("AMSGRAD", "DECOUPLED") + scalars), (q8, ("DECOUPLED",) + scalars),
                      (sgd, ("MOMENTUM", "NESTEROV") + scalars), (lion, scalars),
                      (sgd8, ("NESTEROV",) + scalars), (lion8, scalars)):
        assert {(k["constexprs"]["DT"], k["constexprs"]["MODE"]) for k in ks} == MODE_PAIRS
        for flag in flags:
            assert _values(ks, flag) == {False, True}, flag
        assert _values(ks, "n") == {"i32", "i64"}  # tensors past 2^31 elements
    for ks in (adam, sgd, lion, sgd8, lion8):
        assert _values(ks, "seed") == {"i32", "i64", "u64"}
    for ks in (q8, sgd8, lion8):
        assert _values(ks, "BLOCK") == {64, 128, 256, 512, 1024, 2048, 4096}
    check = _kernels(report, "_check_kernel")
    assert {(k["constexprs"]["DT"], k["constexprs"]["WRITE"], k["constexprs"]["NORM"])
            for k in check} == {(d, w, n) for d in (0, 1, 2) for w in (False, True)
                                for n in (False, True)}


# FMA contraction (fma.*) and Triton's fast defaults (div.full.f32, sqrt.approx.f32, ...): every
# kernel is compiled with enable_fp_fusion=False and uses div_rn / sqrt_rn, so compiled code
# rounds as the interpreter and the CPU kernels do.
_INEXACT = re.compile(r"^\s*(?:@%p\d+\s+)?((?:fma|mad)\.r[nzmp]\S*|\w+\.approx\S*|div\.full\S*)",
                      re.M)  # (integer mad.lo / mad.wide are exact)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_contraction_or_approximate_math(compiled, arch):
    report = _report(compiled, arch)
    for k in report["kernels"]:
        assert k["options"]["enable_fp_fusion"] is False, k["kernel"]
        found = sorted(set(_INEXACT.findall(k["ptx"])))
        assert not found, f"{k['kernel']} {k['constexprs']}: {found}"


def test_the_inexact_math_check_can_fail():
    # The pattern finds what a contracted `x*s - x*s` and Triton's default division compile to.
    ptx = "\tneg.f32 \t%r133, %r115;\n\tfma.rn.f32 \t%r134, %r35, %r9, %r133;\n" \
          "\t@%p3 div.full.f32 %r1, %r2, %r3;\n\tsqrt.approx.ftz.f32 %r4, %r5;\n" \
          "\tmad.lo.s64 %rd1, %rd2, %rd3, %rd4;\n"
    assert _INEXACT.findall(ptx) == ["fma.rn.f32", "div.full.f32", "sqrt.approx.ftz.f32"]


@pytest.mark.parametrize("arch", ARCHS)
def test_elementwise_kernels_vectorize(compiled, arch):
    """Sizes that are multiples of 16 (aligned data, as torch allocates it): the Adam, SGD and
    Lion kernels move their operands in 16-byte vectors both ways and the check reads 16-byte
    vectors. Scalar loads would cost the bandwidth the kernels exist for."""
    report = _report(compiled, arch)
    optimizers = ("_adam_kernel", "_sgd_kernel", "_lion_kernel")
    for k in report["kernels"]:
        if k["kernel"] not in optimizers + ("_check_kernel",) or k["signature"]["n"] != "i32":
            continue
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", k["ptx"]), (k["kernel"], k["constexprs"])
        if k["kernel"] in optimizers:
            assert re.search(r"st\.global(\.\w+)*\.v4\.b32", k["ptx"]), (k["kernel"],
                                                                          k["constexprs"])


@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills(compiled, arch):
    report = _report(compiled, arch)
    for k in report["kernels"]:
        r = k["ptxas"]
        assert r["registers"] is not None, r["log"]
        assert (r["spill_stores"] or 0) == 0 and (r["spill_loads"] or 0) == 0, \
            f"{k['kernel']} {k['constexprs']}: {r['log']}"
