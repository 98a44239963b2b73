"""What the nvcc / g++ build checks share (tests/test_cuda_compile.py, test_cuda_compile_onestate8bit.py,
test_cuda_mta_packing.py, test_cuda_bindings_syntax.py): where the sources and nvcc are, the
flags setup.py builds with (read from setup.py, never run), how a module's compile jobs run and
are checked, and the parsers of ptxas -v's resource report and of the PTX.

Each of those modules runs its own jobs in parallel, once per module, in the background from
collection on (tests/background_builds.py), under one deadline (counted from when that module's
tests start) so the module stays < 2 minutes; a job cut by that deadline (an overloaded machine)
is skipped, not failed (failed under MPFUSED_STRICT_TESTS=1).
"""
from __future__ import annotations

import ast
import concurrent.futures
import glob
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import STRICT, skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
CU_FILES = sorted(f for f in glob.glob(str(ROOT / "csrc" / "cuda" / "*.cu"))  # and per entry:
                  if Path(f).name not in ("sgd8bit_cuda.cu", "lion8bit_cuda.cu"))  # *_onestate8bit.py
ARCHS = ["sm_80", "sm_90"]
BINDINGS = sorted(glob.glob(str(ROOT / "csrc" / "bindings" / "*_cuda.cpp")))

NEEDS_NVCC = pytest.mark.skipif(NVCC is None and not STRICT, reason="nvcc not on PATH")


def _setup_nvcc_flags() -> list[str]:
    """The nvcc flags setup.py builds the extension with (its `nvcc = [...]` literal)."""
    text = (ROOT / "setup.py").read_text()
    m = re.search(r'\bnvcc = (\[[^\]]*\])', text)
    assert m, "setup.py has no `nvcc = [...]` flag list"
    return ast.literal_eval(m.group(1))


SETUP_NVCC_FLAGS = _setup_nvcc_flags()
TIMEOUT = None  # return code of a job cut by the module deadline: skipped, not failed


def _check(result):
    rc, out = result
    if rc is TIMEOUT:
        skip_or_fail(out)
    assert rc == 0, out
    return out


def run_jobs(job, jobs: dict[str, list[list[str]]]) -> dict:
    """Runs a module's compile jobs in parallel through its background `job`: name -> (rc,
    output); each job is a list of commands run in sequence (build, then run), stopping at the
    first failure; rc TIMEOUT: cut by the module deadline."""
    def run_job(cmds):
        outs = []
        for cmd in cmds:  # sequential steps of one job (build, then run)
            rc, out = job.run(cmd)
            outs.append(out)
            if rc != 0:  # a failure or a deadline cut (None)
                return rc, "\n".join(outs)
        return 0, "\n".join(outs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as ex:
        futs = {name: ex.submit(run_job, cmds) for name, cmds in jobs.items()}
        return {name: f.result() for name, f in futs.items()}


def _ptxas_report(out: str) -> dict[str, dict[str, int]]:
    """ptxas -v's resource lines per kernel entry: registers, spill stores, spill loads (bytes)."""
    kernels: dict[str, dict[str, int]] = {}
    name = None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            kernels[name] = {"registers": -1, "spill_stores": 0, "spill_loads": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and "stack frame" in line and kernels[name]["registers"] < 0:
            kernels[name]["spill_stores"] = int(m.group(1))
            kernels[name]["spill_loads"] = int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[name]["registers"] = int(m.group(1))
            name = None  # the entry's report is complete
    return kernels


def _smem(out: str) -> dict[str, int]:
    """Static shared memory bytes per entry (ptxas -v)."""
    res, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"Used \d+ registers.*?(\d+) bytes smem", line)
        if m and name:
            res[name] = int(m.group(1))
    return res


# PTX float instructions that are not IEEE round-to-nearest without flush-to-zero: contracted
# multiply-adds, approximate or flush-to-zero f32 math. (libdevice's double pow has its own
# fma.rn.f64 and one rcp.approx.ftz.f64 by design: f64, so not matched.)
def _inexact_f32(ptx: str) -> list[str]:
    bad = set()
    for tok in re.findall(r"\b[a-z][a-z0-9]*(?:\.[a-z0-9]+)+", ptx):
        parts = tok.split(".")
        if "f32" in parts and (parts[0] in ("fma", "mad") or
                               {"approx", "ftz", "full"} & set(parts)):
            bad.add(tok)
    return sorted(bad)


def _ptx_entries(ptx: str) -> dict[str, str]:
    """PTX entry name -> its text (up to the next .entry or .func)."""
    out = {}
    for part in re.split(r"(?m)^(?=(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\b)", ptx):
        m = re.match(r"(?:\.visible\s+|\.weak\s+)?\.entry\s+(\w+)", part)
        if m:
            out[m.group(1)] = part
    return out
