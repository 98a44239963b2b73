"""The CUDA kernels of sgd4bit_step_ / lion4bit_step_ (cuda::sgd8bit_step / lion8bit_step with
State8bitCommon::code_bits = 4: csrc/cuda/sgd8bit_cuda.cu and lion8bit_cuda.cu on
one_state8bit_cuda.cuh specialized on the code width) run on the host, no GPU and no nvcc needed,
and compared byte for byte, guard bytes included, with the CPU kernels' 4-bit path
(cpu::state8bit_chunk<..., 4>): tests/cuda_emulation/one_state8bit_vs_cpu.cpp run for 4-bit codes.
Its cases: fp32 / fp16 / bf16 tensors in every list x master modes none / fp32 / remainder /
stochastic / remainder8 x block sizes 64..4096, SGD momentum / dampening / Nesterov / weight decay
/ maximize and its first step, Lion, grad_scale, clipping, a device lr, odd sizes (1, 3, 65, 255,
4095, 4097, 13: an odd tensor end's padding nibble), empty tensors, misaligned operands (each
operand in turn: the element-wise path), 120 small tensors (several launches), launches that end
mid-tensor, found_inf skips, NaN / inf gradients, bad maps (4-bit: only an unsorted one; a map
without +0 runs) and bad arguments (block sizes, workspaces, code widths).

The same program, objects and build (tests/test_cuda_emulation_onestate8bit.py's, under memcheck
and racecheck); in a full run the builds are shared with that module, so this one only runs the
program twice. A kernel that passes here has still never run on a GPU.
"""
from __future__ import annotations

import functools
import re

import pytest

from tests import background_builds
from tests.conftest import deadline_s, skip_or_fail
from tests.test_cuda_emulation import BACKGROUND_BUILD as _BUILD, CHECKERS, pytestmark  # noqa: F401
from tests.test_cuda_emulation_onestate8bit import _build_and_run as _build_and_run_bits

DEADLINE_S = deadline_s(300.0)  # alone it builds the objects too (~2 min of 2 loaded cores)
_build_and_run = functools.partial(_build_and_run_bits, bits=4)
BACKGROUND_BUILD = _build_and_run if _BUILD else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return background_builds.result(__name__, _build_and_run, DEADLINE_S, tmp_path_factory)


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_cuda_sgd4bit_and_lion4bit_kernels_match_cpu_kernels(runs, checker):
    if checker not in runs["_checkers"]:
        skip_or_fail(f"the compiler has no working {' '.join(CHECKERS[checker])} here")
    rc, out = runs[checker]
    if rc is None:
        skip_or_fail(out)
    assert rc == 0, f"seed {runs['_seed']}\n{out}"
    assert "ok" in out.splitlines(), out
    m = re.search(r"sgd4bit cases (\d+), lion4bit cases (\d+), bad-argument cases (\d+)", out)
    assert m and all(int(x) > 0 for x in m.groups()), out
    assert "emulated launches" in out
