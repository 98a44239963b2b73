"""The CUDA one-state 8-bit kernels (cuda::sgd8bit_step / lion8bit_step, csrc/cuda/sgd8bit_cuda.cu
and lion8bit_cuda.cu on one_state8bit_cuda.cuh) run on the host, no GPU and no nvcc needed, and
compared byte for byte with the CPU kernels (tests/cuda_emulation/one_state8bit_vs_cpu.cpp: every
dtype x master mode, SGD momentum / dampening / Nesterov / weight decay / maximize / first step,
Lion, grad_scale, clipping, device lr, misaligned operands, split launches, found_inf skips, bad
maps and arguments).

Built as tests/test_cuda_emulation.py builds its programs (same flags, same emulation; the CPU
kernels it compares with uninstrumented), under both checkers: memcheck (AddressSanitizer +
UBSan, poisoned guard bytes) and racecheck (ThreadSanitizer, every emulated thread a fiber
ordered only by barriers and shuffles). A kernel that passes here has still never run on a GPU.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
from pathlib import Path

import pytest

from tests import background_builds
from tests.conftest import deadline_s, skip_or_fail
from tests.test_cuda_emulation import (BACKGROUND_BUILD as _BUILD, CHECKERS, CXX, EMU,  # noqa: F401
                                       EMU_INC, FLAGS, ROOT, build_object, checkers, maps_file,
                                       program_env, pytestmark)

DEADLINE_S = deadline_s(300.0)
CUDA_UNITS = ["sgd8bit_cuda", "lion8bit_cuda"]
CPU_UNITS = ["sgd8bit_cpu", "lion8bit_cpu", "quant8_cpu"]  # quant8_cpu: the encoder, isa_level()
PROGRAM = "one_state8bit_vs_cpu"


def _build_and_run(job, bits: int = 8) -> dict:
    """checker -> (rc, output) of the program built under that checker, run for `bits`-bit codes
    (tests/test_cuda_one_state4bit.py: 4); rc None: cut by the deadline. Objects and programs are
    built in parallel (in the background from collection on, shared with
    tests/test_cuda_emulation.py and the 4-bit module where the same:
    tests/background_builds.py)."""
    tmp = Path(job.tmp)
    found = checkers(job)
    seed = int.from_bytes(os.urandom(4), "little")
    maps = maps_file(job)

    # The CUDA units under each checker. The CPU kernels, the expected side, are built once,
    # plain, for both: instrumented, their per-ISA clones take 3x as long to build (~30 s of CPU
    # each) and they are not what is checked here (TSan could not follow their OpenMP anyway).
    objects: dict[str, tuple[Path, list[str]]] = {}
    for unit in CUDA_UNITS:
        for checker, flags in found.items():
            objects[f"{unit}.{checker}"] = tmp / f"{unit}.{checker}.o", [
                CXX, *FLAGS, *flags, *EMU_INC, "-x", "c++", "-c",
                str(ROOT / "csrc" / "cuda" / f"{unit}.cu")]
    for unit in CPU_UNITS:
        objects[f"{unit}.plain"] = tmp / f"{unit}.plain.o", [
            CXX, *FLAGS, "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp")]
    env = program_env()

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(objects) + len(found)) as ex:
        built = {k: ex.submit(build_object, job, cmd, out) for k, (out, cmd) in objects.items()}

        def build_and_run(checker: str):
            deps = [f"{u}.{checker}" for u in CUDA_UNITS] + [f"{u}.plain" for u in CPU_UNITS]
            paths = []
            for d in deps:
                rc, out, path = built[d].result()
                if rc != 0:
                    return rc, out
                paths.append(str(path))
            rc, out, exe = build_object(job, [CXX, *FLAGS, *found[checker], *EMU_INC,
                                              str(EMU / f"{PROGRAM}.cpp"), *paths],
                                        tmp / f"{PROGRAM}.{checker}")
            if rc != 0:
                return rc, out
            return job.run([str(exe), str(maps), str(seed), str(bits)], env)

        res = {c: f.result() for c, f in
               {c: ex.submit(build_and_run, c) for c in found}.items()}
    res["_seed"] = seed
    res["_checkers"] = found
    return res


BACKGROUND_BUILD = _build_and_run if _BUILD else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return background_builds.result(__name__, _build_and_run, DEADLINE_S, tmp_path_factory)


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_cuda_sgd8bit_and_lion8bit_kernels_match_cpu_kernels(runs, checker):
    if checker not in runs["_checkers"]:
        skip_or_fail(f"the compiler has no working {' '.join(CHECKERS[checker])} here")
    rc, out = runs[checker]
    if rc is None:
        skip_or_fail(out)
    assert rc == 0, f"seed {runs['_seed']}\n{out}"
    assert "ok" in out.splitlines(), out
    m = re.search(r"sgd8bit cases (\d+), lion8bit cases (\d+), bad-argument cases (\d+)", out)
    assert m and all(int(x) > 0 for x in m.groups()), out
    assert "emulated launches" in out
