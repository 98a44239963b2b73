"""The CUDA kernels run on the host, no GPU and no nvcc needed (tests/cuda_emulation/).

csrc/cuda/*.cu are compiled unchanged as C++ by g++, with tests/cuda_emulation/cuda_runtime.h
standing in for the toolkit header: every launch runs each block as cooperative host threads with
CUDA's barrier, vote and warp-shuffle semantics, blocks in a shuffled order, fresh (0xFF) shared
memory per block. Three programs:

* emulator_selftest: the emulation against CUDA's semantics, and proof that it reports a divergent
  barrier, a missing barrier and a read of shared memory nothing wrote;
* amp_adam_vs_cpu: cuda::amp_check / update_scale / adam_step / increment_steps against the CPU
  kernels, byte for byte (sums of squares against an exact double sum);
* adam8bit_vs_cpu: cuda::adam8bit_step against cpu::adam8bit_step, byte for byte.

Built with AddressSanitizer + UndefinedBehaviorSanitizer when the compiler has them: the guard
bytes around every buffer are poisoned, so an out-of-bounds read or write, a misaligned vector
access or a signed overflow fails the run, as compute-sanitizer's memcheck would on a GPU.

This checks indexing, synchronization and per-element math; not timing, not the memory model
between blocks, not device intrinsics. A kernel that passes here has still never run on a GPU.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emulation"
CXX = shutil.which("g++") or shutil.which("c++")
DEADLINE_S = 300.0
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer"]
# As the extension builds its kernels: no FMA contraction anywhere (setup.py: -ffp-contract=off
# for C++, --fmad=false for CUDA), so the emulated CUDA math is the CPU kernels' to the bit.
FLAGS = ["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
         "-Wall", "-Wno-unknown-pragmas", "-I", str(ROOT / "csrc" / "include")]
EMU_INC = ["-I", str(EMU), "-I", str(ROOT / "csrc" / "cuda")]

pytestmark = pytest.mark.skipif(
    CXX is None or not sys.platform.startswith("linux"),
    reason="needs g++ on Linux (ucontext, dl_iterate_phdr)")


def _sanitizers_work(tmp: Path) -> bool:
    src = tmp / "probe.cpp"
    src.write_text("#include <vector>\nint main() { std::vector<int> v(3); return v[1]; }\n")
    exe = tmp / "probe"
    try:
        build = subprocess.run([CXX, *SANITIZE, str(src), "-o", str(exe)], capture_output=True,
                               timeout=60)
        return build.returncode == 0 and subprocess.run([str(exe)], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run(cmd: list[str], deadline: float, env=None) -> tuple[int | None, str]:
    left = deadline - time.monotonic()
    if left <= 1:
        return None, "not run: module deadline reached (machine too busy?)"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
    except subprocess.TimeoutExpired:
        return None, f"cut by the module deadline ({DEADLINE_S:.0f} s): {' '.join(cmd)}"
    return p.returncode, f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}"


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Builds the three programs and runs them once (in parallel); name -> (rc, output)."""
    tmp = tmp_path_factory.mktemp("cuda_emulation")
    deadline = time.monotonic() + DEADLINE_S
    sanitized = _sanitizers_work(tmp)
    flags = FLAGS + (SANITIZE if sanitized else [])
    seed = int.from_bytes(os.urandom(4), "little")  # fresh data and interleavings each run

    from mpfused.quant_maps import signed_map, unsigned_map
    maps = tmp / "maps.bin"
    maps.write_bytes(struct.pack("<512f", *(signed_map().tolist() + unsigned_map().tolist())))

    def obj(src: Path, kind: str) -> tuple[Path, list[str]]:
        out = tmp / f"{src.stem}.{kind}.o"
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        inc = EMU_INC if kind == "emu" else []
        return out, [CXX, *flags, *inc, *lang, "-c", str(src), "-o", str(out)]

    objects = {}
    for name in ["amp", "adam", "adam8bit"]:
        objects[f"{name}.cpu"] = obj(ROOT / "csrc" / "cpu" / f"{name}_cpu.cpp", "cpu")
        objects[f"{name}.emu"] = obj(ROOT / "csrc" / "cuda" / f"{name}_cuda.cu", "emu")
    progs = {
        "emulator_selftest": ([], []),
        "amp_adam_vs_cpu": (["amp.emu", "adam.emu", "amp.cpu", "adam.cpu"], [str(seed)]),
        "adam8bit_vs_cpu": (["adam8bit.emu", "adam8bit.cpu"], [str(maps), str(seed)]),
    }
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1", OMP_NUM_THREADS="2")

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        built = {k: ex.submit(_run, cmd, deadline) for k, (_, cmd) in objects.items()}

        def build_and_run(name: str) -> tuple[int | None, str]:
            deps, args = progs[name]
            for d in deps:
                rc, out = built[d].result()
                if rc != 0:
                    return rc, out
            exe = tmp / name
            rc, out = _run([CXX, *flags, *EMU_INC, str(EMU / f"{name}.cpp"),
                            *(str(objects[d][0]) for d in deps), "-o", str(exe)], deadline)
            if rc != 0:
                return rc, out
            return _run([str(exe), *args], deadline, env)

        results = {name: ex.submit(build_and_run, name) for name in progs}
        res = {name: f.result() for name, f in results.items()}
    res["_sanitized"] = sanitized
    res["_seed"] = seed
    return res


def _check(programs, name: str) -> str:
    rc, out = programs[name]
    if rc is None:
        pytest.skip(out)
    assert rc == 0, f"seed {programs['_seed']}\n{out}"
    assert "ok" in out.splitlines(), out
    return out


def test_emulator_reports_what_it_claims_to(programs):
    out = _check(programs, "emulator_selftest")
    assert "__syncthreads that not every thread of the block reaches" in out


def test_cuda_amp_and_adam_kernels_match_cpu_kernels(programs):
    out = _check(programs, "amp_adam_vs_cpu")
    assert "emulated launches" in out


def test_cuda_adam8bit_kernel_matches_cpu_kernel(programs):
    _check(programs, "adam8bit_vs_cpu")

