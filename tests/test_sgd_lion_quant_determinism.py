"""The block-wise SGD / Lion kernels (sgd8bit_step_ / lion8bit_step_, sgd4bit_step_ /
lion4bit_step_) are deterministic, on the one harness (tests/sgd_lion_quant_harness.py): the
native CPU kernels give the same bytes for any thread count and from every ISA build (baseline,
x86-64-v3, v4, v4 + VBMI: tests/isa_builds.py runs isa_digest8 / isa_digest4 once per build);
the Triton interpreter gives the native kernel's bytes at 4 bits (at 8 bits:
tests/test_backend_agreement.py, over the named step cases)."""
import hashlib
import random

import pytest
import torch

from tests import isa_builds
from tests.sgd_lion_quant_cases import DTYPE_MODES
from tests.sgd_lion_quant_harness import (BF16, KEYS, KINDS, STOCHASTIC, clone_state, every_width,
                                          make_state, op_name, require, step)
from tests.test_sgd_lion_kernels import bits_equal


@every_width
def test_bit_identical_for_any_thread_count(bits):
    for kind in KINDS:
        require(op_name(kind, bits), "cpu", "native")
    c = make_state([(200_001,), (3001,)], BF16, STOCHASTIC, "cpu", 256, op=op_name("sgd", bits))
    outs, n = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for kind in KINDS:
                d = clone_state(c)
                step(op_name(kind, bits), d, "native", block_size=256, master_mode=STOCHASTIC)
                outs.append(d)
    finally:
        torch.set_num_threads(n)
    for d, e in zip(outs[2:], outs):
        for k in KEYS:
            assert all(bits_equal(x, y) for x, y in zip(d[k], e[k])), k


def isa_digest(seed: int, bits: int, dtype_modes) -> str:
    """The bytes both kernels of a width write over dtype_modes (tiles, blocks and a multi-chunk
    tensor; first and later steps)."""
    h = hashlib.sha256()
    for kind in KINDS:
        op = op_name(kind, bits)
        for name in dtype_modes:
            dtype, mode = DTYPE_MODES[name]
            random.seed(seed)
            torch.manual_seed(seed)
            c = make_state([(1,), (63,), (64,), (65,), (1001,), (70001,)], dtype, mode, "cpu",
                           256 if bits == 8 else 128, steps=[0, 4] * 3, op=op, tiny=True)
            for _ in range(2):
                step(op, c, "native", weight_decay=1e-2, master_mode=mode,
                     block_size=256 if bits == 8 else 128)
            for k in KEYS:
                for t in c[k]:
                    h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def isa_digest8(seed: int) -> str:
    return isa_digest(seed, 8, [n for n in DTYPE_MODES if n != "bf16-remainder8"])


def isa_digest4(seed: int) -> str:  # fp32, fp32 master, SR, remainder8
    return isa_digest(seed, 4, ["f32", "f16-master", "bf16-sr", "bf16-remainder8"])


@every_width
def test_every_cpu_isa_build_is_bit_identical(bits):
    """Every build must give the same bytes (4-bit: the vpermps decode on v4; a VBMI CPU takes
    v4); the processes are shared with the other block-wise families (tests/isa_builds.py)."""
    require(op_name("sgd", bits), "cpu", "native")
    digests = isa_builds.digests(f"sgd_lion_{bits}bit")
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("kind", KINDS)
def test_4bit_triton_interpreter_equals_native_bit_for_bit(kind):
    op = op_name(kind, 4)
    require(op, "cpu", "native")
    require(op, "cpu", "triton")
    for name in ["f32", "f16", "bf16-remainder", "bf16-sr", "bf16-remainder8"]:
        dtype, mode = DTYPE_MODES[name]
        a = make_state([(700,), (129,), (1,), (0,), (257,)], dtype, mode, "cpu", 64,
                       steps=[0, 3, 0, 3, 0], op=op)
        b = clone_state(a)
        gen = torch.Generator().manual_seed(11)
        for s in range(3):
            grads = [(torch.randn(x.numel(), generator=gen) * 1e-2).to(dtype)
                     for x in a["params"]]
            a["grads"], b["grads"] = grads, [x.clone() for x in grads]
            found = torch.ones(()) if s == 1 else None
            kw = dict(found_inf=found, weight_decay=1e-2, block_size=64, master_mode=mode)
            step(op, a, "native", **kw)
            step(op, b, "triton", **kw)
        for k in KEYS:
            assert all(bits_equal(x, y) for x, y in zip(a[k], b[k])), (name, k)
