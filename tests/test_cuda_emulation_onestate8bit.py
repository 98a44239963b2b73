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
import struct
import time

import pytest

from tests.conftest import deadline_s, skip_or_fail
from tests.test_cuda_emulation import (CHECKERS, CXX, EMU, EMU_INC, FLAGS, ROOT, _run,
                                       _sanitizer_works, pytestmark)  # noqa: F401

DEADLINE_S = deadline_s(300.0)
CUDA_UNITS = ["sgd8bit_cuda", "lion8bit_cuda"]
CPU_UNITS = ["sgd8bit_cpu", "lion8bit_cpu", "quant8_cpu"]  # quant8_cpu: the encoder, isa_level()
PROGRAM = "one_state8bit_vs_cpu"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """checker -> (rc, output) of the program built under that checker; rc None: cut by the
    deadline. Objects are built in parallel."""
    tmp = tmp_path_factory.mktemp("cuda_emulation_onestate8bit")
    deadline = time.monotonic() + DEADLINE_S
    checkers = {}
    for name, flags in CHECKERS.items():
        if _sanitizer_works(tmp, flags):
            checkers[name] = flags
        elif name == "memcheck":
            checkers[name] = []  # plain build: every byte is still compared
    seed = int.from_bytes(os.urandom(4), "little")

    from mpfused.quant_maps import signed_map, unsigned_map
    maps = tmp / "maps.bin"
    maps.write_bytes(struct.pack("<512f", *(signed_map().tolist() + unsigned_map().tolist())))

    # The CUDA units under each checker. The CPU kernels, the expected side, are built once,
    # plain, for both: instrumented, their per-ISA clones take 3x as long to build (~30 s of CPU
    # each) and they are not what is checked here (TSan could not follow their OpenMP anyway).
    objects: dict[str, list[str]] = {}
    for unit in CUDA_UNITS:
        for checker, flags in checkers.items():
            objects[f"{unit}.{checker}"] = [
                CXX, *FLAGS, *flags, *EMU_INC, "-x", "c++", "-c",
                str(ROOT / "csrc" / "cuda" / f"{unit}.cu"), "-o", str(tmp / f"{unit}.{checker}.o")]
    for unit in CPU_UNITS:
        objects[f"{unit}.plain"] = [CXX, *FLAGS, "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp"),
                                    "-o", str(tmp / f"{unit}.plain.o")]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               TSAN_OPTIONS="exitcode=66", OMP_NUM_THREADS="2")

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        built = {k: ex.submit(_run, cmd, deadline) for k, cmd in objects.items()}

        def build_and_run(checker: str):
            deps = [f"{u}.{checker}" for u in CUDA_UNITS] + [f"{u}.plain" for u in CPU_UNITS]
            for d in deps:
                rc, out = built[d].result()
                if rc != 0:
                    return rc, out
            exe = tmp / f"{PROGRAM}.{checker}"
            rc, out = _run([CXX, *FLAGS, *checkers[checker], *EMU_INC, str(EMU / f"{PROGRAM}.cpp"),
                            *(objects[d][-1] for d in deps), "-o", str(exe)], deadline)
            if rc != 0:
                return rc, out
            return _run([str(exe), str(maps), str(seed)], deadline, env)

        res = {c: f.result() for c, f in
               {c: ex.submit(build_and_run, c) for c in checkers}.items()}
    res["_seed"] = seed
    res["_checkers"] = checkers
    return res


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
