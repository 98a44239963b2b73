"""The CUDA kernels run on the host, no GPU and no nvcc needed (tests/cuda_emulation/).

csrc/cuda/*.cu are compiled unchanged as C++ by g++, with tests/cuda_emulation/cuda_runtime.h
standing in for the toolkit header: every launch runs each block as cooperative host threads with
CUDA's barrier, vote and warp-shuffle semantics, blocks in a shuffled order, fresh (0xFF) shared
memory per block. Four programs:

* emulator_selftest: the emulation against CUDA's semantics, and proof that it reports a divergent
  barrier, threads meeting at different barriers or shuffles, a missing barrier (also one only a
  shuffle "separates") and a read of shared memory nothing wrote;
* amp_adam_vs_cpu: cuda::amp_check / update_scale / adam_step / increment_steps against the CPU
  kernels, byte for byte (sums of squares against an exact double sum);
* adam8bit_vs_cpu: cuda::adam8bit_step (its prepare and main launches) against
  cpu::adam8bit_step, byte for byte, and what the step leaves in its workspace, for both code
  widths (8-bit codes: adam8bit_step_; 4-bit packed codes, 16-entry maps: adam4bit_step_);
* sgd_lion_vs_cpu: cuda::sgd_step / lion_step (the generic elementwise kernel) + increment_steps
  against the shared per-element math run as the CPU kernels run it, byte for byte.

Each is built twice, as the two compute-sanitizer tools a GPU run would use:
* memcheck: AddressSanitizer + UndefinedBehaviorSanitizer; the guard bytes around every buffer are
  poisoned, so an out-of-bounds access, a misaligned vector access or a signed overflow fails;
* racecheck: ThreadSanitizer, every emulated thread a TSan fiber ordered only by barriers and
  shuffles, so two threads of a block touching the same memory without a barrier is a data race
  (the CPU kernels it compares with are linked uninstrumented).
A compiler without a sanitizer runtime gives a plain build (memcheck) or a skip (racecheck).

This checks indexing, synchronization and per-element math; not timing, not the memory model
between blocks, not device intrinsics. A kernel that passes here has still never run on a GPU.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import STRICT, deadline_s, skip_or_fail  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emulation"
CXX = shutil.which("g++") or shutil.which("c++")
DEADLINE_S = deadline_s(300.0)
CHECKERS = {
    "memcheck": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                 "-fno-omit-frame-pointer"],
    "racecheck": ["-fsanitize=thread"],
}
SGD_LION_CPU = [u for u in ("sgd_cpu", "lion_cpu")
                if (ROOT / "csrc" / "cpu" / f"{u}.cpp").exists()]
# Each program and what it links: csrc/cuda units (built under each checker), csrc/cpu units.
UNITS = {
    "emulator_selftest": ([], []),
    "amp_adam_vs_cpu": (["amp_cuda", "adam_cuda", "step_counters_cuda"], ["amp_cpu", "adam_cpu"]),
    "adam8bit_vs_cpu": (["adam8bit_cuda"], ["adam8bit_cpu", "quant8_cpu"]),  # isa_level()
    # Without csrc/cpu/sgd_cpu and lion_cpu the driver compares with its own loop over the shared
    # per-element functions (and says so).
    "sgd_lion_vs_cpu": (["sgd_cuda", "lion_cuda", "step_counters_cuda"], SGD_LION_CPU),
}
PROGRAMS = list(UNITS)
# emulator_selftest's deliberately racy kernels, each of which racecheck must report.
RACES = {"race-barrier": "broadcast", "race-shuffle": "across_a_shuffle"}
# As the extension builds its kernels: no FMA contraction anywhere (setup.py: -ffp-contract=off
# for C++, --fmad=false for CUDA), so the emulated CUDA math is the CPU kernels' to the bit.
FLAGS = ["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
         "-Wall", "-Wno-unknown-pragmas", "-I", str(ROOT / "csrc" / "include")]
EMU_INC = ["-I", str(EMU), "-I", str(ROOT / "csrc" / "cuda")]

pytestmark = pytest.mark.skipif(
    CXX is None or not sys.platform.startswith("linux"),
    reason="needs g++ on Linux (ucontext, dl_iterate_phdr)")


def _sanitizer_works(job, flags: list[str]) -> bool:
    """Whether `flags` build and run a program here (once per session: the emulation modules
    share it)."""
    def probe():
        src = Path(job.tmp) / f"probe{len(flags)}.cpp"
        src.write_text("#include <vector>\nint main() { std::vector<int> v(3); return v[1]; }\n")
        exe = src.with_suffix("")
        rc, _ = job.run([CXX, *flags, str(src), "-o", str(exe)])
        return rc == 0 and job.run([str(exe)])[0] == 0
    return background_builds.once(("sanitizer_works", *flags), job, probe)


def checkers(job) -> dict[str, list[str]]:
    """The CHECKERS this compiler can build; memcheck without a sanitizer runtime: a plain build
    (every byte is still compared)."""
    found = {}
    for name, flags in CHECKERS.items():
        if _sanitizer_works(job, flags):
            found[name] = flags
        elif name == "memcheck":
            found[name] = []
    return found


def maps_file(job) -> Path:
    """The quantization maps as little-endian floats, the quantized programs' input: the 8-bit
    signed and unsigned maps (512), then the 4-bit ones (32; read by adam8bit_vs_cpu only)."""
    from mpfused.quant4 import signed4_map, unsigned4_map
    from mpfused.quant_maps import signed_map, unsigned_map
    maps = Path(job.tmp) / "maps.bin"
    maps.write_bytes(struct.pack("<544f", *(signed_map().tolist() + unsigned_map().tolist()
                                            + signed4_map().tolist() + unsigned4_map().tolist())))
    return maps


def build_object(job, cmd: list[str], out: Path) -> tuple[int | None, str, Path]:
    """`cmd -o out`, once per session for the same cmd (the emulation modules share objects):
    (rc, output, the object's path)."""
    def build():
        return (*job.run([*cmd, "-o", str(out)]), out)
    return background_builds.once(("object", *cmd), job, build)


def program_env() -> dict:
    """The programs' environment: the sanitizers' options, two OpenMP threads for the CPU kernels,
    and OpenMP's default wait policy, not conftest's PASSIVE: under ThreadSanitizer the passive
    wake-ups slow the CPU kernels' parallel regions (adam8bit_vs_cpu.racecheck: 139 s with the
    default policy, not done after 150 s with PASSIVE, on the loaded 2-core VM)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               TSAN_OPTIONS="exitcode=66", OMP_NUM_THREADS="2")
    return env


def _build_and_run(job) -> dict:
    """Builds every program for each checker and runs it once, all in parallel (in the
    background from collection on: tests/background_builds.py).
    (checker, name) -> (rc, output); rc None: cut by the deadline."""
    tmp = Path(job.tmp)
    found = checkers(job)
    seed = int.from_bytes(os.urandom(4), "little")  # fresh data and interleavings each run
    maps = maps_file(job)

    # Objects: the CUDA files under each checker; the CPU kernels under memcheck, and plain for
    # racecheck (their OpenMP runtime is not instrumented, so TSan could not follow it).
    objects: dict[str, tuple[Path, list[str]]] = {}
    for unit in sorted({u for cuda, _ in UNITS.values() for u in cuda}):
        for checker, flags in found.items():
            objects[f"{unit}.{checker}"] = tmp / f"{unit}.{checker}.o", [
                CXX, *FLAGS, *flags, *EMU_INC, "-x", "c++", "-c",
                str(ROOT / "csrc" / "cuda" / f"{unit}.cu")]
    for unit in sorted({u for _, cpu in UNITS.values() for u in cpu}):
        for kind, flags in [("memcheck", found["memcheck"]), ("plain", [])]:
            if kind == "plain" and "racecheck" not in found:
                continue
            objects[f"{unit}.{kind}"] = tmp / f"{unit}.{kind}.o", [
                CXX, *FLAGS, *flags, "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp")]

    def deps(name: str, checker: str) -> list[str]:
        cpu = "memcheck" if checker == "memcheck" else "plain"
        cuda_units, cpu_units = UNITS[name]
        return [f"{u}.{checker}" for u in cuda_units] + [f"{u}.{cpu}" for u in cpu_units]

    args = {"emulator_selftest": [], "amp_adam_vs_cpu": [str(seed)],
            "adam8bit_vs_cpu": [str(maps), str(seed)], "sgd_lion_vs_cpu": [str(seed)]}
    env = program_env()

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(objects) + 2 * len(UNITS)) as ex:
        built = {k: ex.submit(build_object, job, cmd, out) for k, (out, cmd) in objects.items()}

        def build_and_run(name: str, checker: str) -> dict:
            paths = []
            for d in deps(name, checker):
                rc, out, path = built[d].result()
                if rc != 0:
                    return {"run": (rc, out)}
                paths.append(str(path))
            exe = tmp / f"{name}.{checker}"
            rc, out = job.run([CXX, *FLAGS, *found[checker], *EMU_INC, str(EMU / f"{name}.cpp"),
                               *paths, "-o", str(exe)])
            if rc != 0:
                return {"run": (rc, out)}
            res = {"run": job.run([str(exe), *args[name]], env)}
            if name == "emulator_selftest" and checker == "racecheck":
                for race in RACES:
                    res[race] = job.run([str(exe), race], env)
            return res

        futures = {(n, c): ex.submit(build_and_run, n, c) for n in PROGRAMS for c in found}
        res = {}
        for (n, c), f in futures.items():
            for what, r in f.result().items():
                res[(c, n if what == "run" else f"{n} {what}")] = r
    res["_seed"] = seed
    res["_checkers"] = found
    return res


BACKGROUND_BUILD = _build_and_run if CXX is not None and sys.platform.startswith("linux") else None


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    return background_builds.result(__name__, _build_and_run, DEADLINE_S, tmp_path_factory)


def _check(programs, checker: str, name: str) -> str:
    if checker not in programs["_checkers"]:
        skip_or_fail(f"the compiler has no working {' '.join(CHECKERS[checker])} here")
    rc, out = programs[(checker, name)]
    if rc is None:
        skip_or_fail(out)
    assert rc == 0, f"seed {programs['_seed']}\n{out}"
    assert "ok" in out.splitlines(), out
    return out


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_emulator_reports_what_it_claims_to(programs, checker):
    out = _check(programs, checker, "emulator_selftest")
    if checker == "memcheck":  # TSan cannot follow a block whose threads never finish
        assert "__syncthreads that not every thread of the block reaches" in out


@pytest.mark.parametrize("race", list(RACES))
def test_racecheck_reports_a_missing_barrier(programs, race):
    # race-shuffle: a shuffle between a write and a read of shared memory orders nothing.
    if "racecheck" not in programs["_checkers"]:
        skip_or_fail("the compiler has no working -fsanitize=thread here")
    rc, out = programs[("racecheck", f"emulator_selftest {race}")]
    if rc is None:
        skip_or_fail(out)
    assert rc != 0 and "WARNING: ThreadSanitizer: data race" in out, out
    summary = [line for line in out.splitlines() if line.startswith("SUMMARY: ThreadSanitizer")]
    # "... in broadcast" with line tables, "... in (anonymous namespace)::broadcast(int*, bool)"
    # without.
    assert summary and all(re.search(rf"\b{RACES[race]}\b", line) for line in summary), out


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_cuda_amp_and_adam_kernels_match_cpu_kernels(programs, checker):
    out = _check(programs, checker, "amp_adam_vs_cpu")
    assert "emulated launches" in out


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_cuda_adam8bit_kernel_matches_cpu_kernel(programs, checker):
    """Both code widths: adam8bit_step_'s and adam4bit_step_'s CUDA kernel."""
    out = _check(programs, checker, "adam8bit_vs_cpu")
    m = re.search(r"8-bit cases (\d+), 4-bit cases (\d+), bad-argument cases (\d+)", out)
    assert m and all(int(x) > 0 for x in m.groups()), out


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_cuda_sgd_and_lion_kernels_match_cpu_kernels(programs, checker):
    out = _check(programs, checker, "sgd_lion_vs_cpu")
    assert "emulated launches" in out
    if SGD_LION_CPU:  # the CPU kernels are what it compared with
        assert "expected: cpu::sgd_step / cpu::lion_step" in out, out
