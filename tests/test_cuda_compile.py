"""Standalone build checks of the CUDA backend that need no GPU, only nvcc on PATH:

* every csrc/cuda/*.cu compiles with `nvcc -c -std=c++17 -arch=sm_80` and `-arch=sm_90` (the
  kernels are torch-free, include path csrc/include only), sm_80 with the 4 KB kernel-parameter
  launches of toolkits < 12.1, sm_90 with the 32 KB ones;
* the multi-tensor packing (mta_pack + mta_locate of multi_tensor_apply.cuh) is run on the host
  against an exhaustive check of which block runs which chunk, including tensors > 2^31 elements
  and launches that split a tensor;
* the CUDA bindings (csrc/bindings/*_cuda.cpp) pass `g++ -fsyntax-only` against torch's headers
  when the installed torch ships c10/cuda headers (a CPU wheel does, minus one generated header
  that is stubbed here) and a CUDA toolkit include dir is found.

All jobs run in parallel, once per module, in the background from collection on
(tests/background_builds.py), under one deadline (counted from when this module's tests start) so
the module stays < 2 minutes; a job cut by that deadline (an overloaded machine) is skipped, not
failed (failed under MPFUSED_STRICT_TESTS=1).
"""
from __future__ import annotations

import ast
import concurrent.futures
import glob
import os
import re
import shutil
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import STRICT, deadline_s, skip_or_fail  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
CU_FILES = sorted(f for f in glob.glob(str(ROOT / "csrc" / "cuda" / "*.cu"))  # and per entry:
                  if Path(f).name not in ("sgd8bit_cuda.cu", "lion8bit_cuda.cu"))  # *_onestate8bit.py
ARCHS = ["sm_80", "sm_90"]
BINDINGS = sorted(glob.glob(str(ROOT / "csrc" / "bindings" / "*_cuda.cpp")))
DEADLINE_S = deadline_s(110.0)

pytestmark = pytest.mark.skipif(NVCC is None and not STRICT, reason="nvcc not on PATH")

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


def _setup_nvcc_flags() -> list[str]:
    """The nvcc flags setup.py builds the extension with (its `nvcc = [...]` literal)."""
    text = (ROOT / "setup.py").read_text()
    m = re.search(r'\bnvcc = (\[[^\]]*\])', text)
    assert m, "setup.py has no `nvcc = [...]` flag list"
    return ast.literal_eval(m.group(1))


def _setup_cxx_flags() -> list[str]:
    """The string literals of setup.py's `cxx = [...]` host flag list."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "cxx"
                and isinstance(node.value, ast.List)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    raise AssertionError("setup.py has no `cxx = [...]` flag list")


def _setup_cxx_std(torch_include: str) -> str:
    """The C++ standard setup.py builds the bindings with (its _cxx_std: torch 2.14 needs C++20),
    without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_cxx_std"]
    assert keep, "setup.py has no _cxx_std"
    ns = {"os": os, "re": re}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    return ns["_cxx_std"](torch_include)


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


SETUP_NVCC_FLAGS = _setup_nvcc_flags()
TIMEOUT = None  # return code of a job cut by the module deadline: skipped, not failed


def _check(result):
    rc, out = result
    if rc is TIMEOUT:
        skip_or_fail(out)
    assert rc == 0, out
    return out


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
    src = tmp / "pack_test.cu"
    src.write_text(PACK_TEST)
    exe = tmp / "pack_test"
    jobs["pack_test"] = [[NVCC, "-std=c++17", "-DMPF_CUDA_KERNEL_PARAMS_BY_DRIVER", "-I",
                          str(ROOT / "csrc" / "include"), "-I", str(ROOT / "csrc" / "cuda"),
                          str(src), "-o", str(exe)], [str(exe)]]
    bindings = _binding_cmds(tmp)
    if isinstance(bindings, dict):
        for name, cmd in bindings.items():
            jobs[f"bindings:{name}"] = [cmd]

    def run_job(cmds):
        outs = []
        for cmd in cmds:  # sequential steps of one job (build, then run)
            rc, out = job.run(cmd)
            outs.append(out)
            if rc != 0:  # a failure or a deadline cut (None)
                return rc, "\n".join(outs)
        return 0, "\n".join(outs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        futs = {name: ex.submit(run_job, cmds) for name, cmds in jobs.items()}
        res = {name: f.result() for name, f in futs.items()}
    res["_bindings_skip"] = bindings if isinstance(bindings, str) else None
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


def _ptx_entries(ptx: str) -> dict[str, str]:
    """PTX entry name -> its text (up to the next .entry or .func)."""
    out = {}
    for part in re.split(r"(?m)^(?=(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\b)", ptx):
        m = re.match(r"(?:\.visible\s+|\.weak\s+)?\.entry\s+(\w+)", part)
        if m:
            out[m.group(1)] = part
    return out


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


def test_multi_tensor_packing_on_host(results):
    out = _check(results["pack_test"])
    assert out.rstrip().endswith("ok"), out


@pytest.mark.parametrize("binding", [Path(b).name for b in BINDINGS])
def test_cuda_bindings_syntax(results, binding):
    if results["_bindings_skip"]:
        pytest.skip(results["_bindings_skip"])
    _check(results[f"bindings:{binding}"])
