"""The CUDA bindings (csrc/bindings/*_cuda.cpp) pass `g++ -fsyntax-only` against torch's headers,
with the C++ standard setup.py builds them with, when the installed torch ships c10/cuda headers
(a CPU wheel does, minus one generated header that is stubbed here) and a CUDA toolkit include
dir is found; otherwise skipped, naming what is missing. With torch's CUDA wheel this is the check
of the bindings against the headers users build with (.ci/run's CUDA-torch stage).

The checks are background jobs from collection on (tests/cuda_compile_common.py,
tests/background_builds.py) under this module's deadline.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import deadline_s
from tests.cuda_compile_common import BINDINGS, NEEDS_NVCC, NVCC, ROOT, _check, run_jobs

DEADLINE_S = deadline_s(110.0)

pytestmark = NEEDS_NVCC


def _cuda_include() -> str | None:
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        cands.append(str(Path(os.path.realpath(NVCC)).parents[1]))
    for c in cands:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return str(Path(c) / "include")
    return None


def _binding_cmds(tmp: Path) -> dict[str, list[str]] | str:
    """g++ -fsyntax-only commands for the CUDA bindings, or the reason they cannot run."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return "no host C++ compiler"
    try:
        from torch.utils import cpp_extension
    except ImportError:
        return "torch not importable"
    inc = cpp_extension.include_paths()
    if not any((Path(p) / "c10" / "cuda" / "CUDAStream.h").exists() for p in inc):
        return "torch ships no c10/cuda headers"
    cuda_inc = _cuda_include()
    if cuda_inc is None:
        return "no CUDA toolkit include dir (cuda_runtime_api.h)"
    stub = tmp / "stub"
    if not any((Path(p) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in inc):
        # Generated at torch build time and absent from CPU wheels; its only content is this.
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True, exist_ok=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags = [_setup_cxx_std(inc[0]), "-fsyntax-only", "-I", str(ROOT / "csrc" / "include")]
    for p in [*inc, cuda_inc, str(stub)]:
        flags += ["-isystem", p]
    return {Path(b).name: [cxx, *flags, b] for b in BINDINGS}


def _setup_cxx_std(torch_include: str) -> str:
    """The C++ standard setup.py builds the bindings with (its _cxx_std: torch 2.14 needs C++20),
    without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_cxx_std"]
    assert keep, "setup.py has no _cxx_std"
    ns = {"os": os, "re": re}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    return ns["_cxx_std"](torch_include)


def _build(job) -> dict:
    """The bindings' syntax checks, in parallel (in the background from collection on:
    tests/background_builds.py). name -> (rc, output); rc TIMEOUT: cut by the module deadline."""
    tmp = Path(job.tmp)
    bindings = _binding_cmds(tmp)
    res = {}
    if isinstance(bindings, dict):
        res = run_jobs(job, {f"bindings:{name}": [cmd] for name, cmd in bindings.items()})
    res["_bindings_skip"] = bindings if isinstance(bindings, str) else None
    return res


BACKGROUND_BUILD = _build if NVCC is not None else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return background_builds.result(__name__, _build, DEADLINE_S, tmp_path_factory)


@pytest.mark.parametrize("binding", [Path(b).name for b in BINDINGS])
def test_cuda_bindings_syntax(results, binding):
    if results["_bindings_skip"]:
        pytest.skip(results["_bindings_skip"])
    _check(results[f"bindings:{binding}"])
