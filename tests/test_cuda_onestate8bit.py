"""Native CUDA sgd8bit_step_ / lion8bit_step_ (csrc/cuda/sgd8bit_cuda.cu, lion8bit_cuda.cu via
csrc/bindings/sgd8bit_ops_cuda.cpp, lion8bit_ops_cuda.cpp) against the native CPU kernels, bit for
bit: the same per-element functions in the same order on both (no FMA contraction, IEEE
division), so params, masters, codes, absmax and step counters must be identical after each of
three steps, over the named step cases of tests/sgd_lion_quant_cases.py (every dtype, master mode
with the remainder8 one, block size, SGD / Lion option, loss scale, clipping, device lr,
stochastic-rounding streams), with
contiguous operands and with operands one element past an aligned start (the kernel's
element-wise path), and a skipped step. Every CUDA call runs under
torch.cuda.set_sync_debug_mode("error"): the path never synchronizes with the host.

Skipped without a GPU or when the extension was built without its CUDA kernels (the host
emulation, tests/test_cuda_emulation_onestate8bit.py, runs the same comparison on the host).
"""
import contextlib
import random

import pytest
import torch

from mpfused import _extension
from tests import sgd_lion_quant_harness as Q
from tests import test_sgd_lion_kernels as SL
from tests.sgd_lion_quant_cases import MIXED, STEP_CASES, case_state, shapes_for

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _extension.with_cuda(),
                       reason="mpfused extension built without its CUDA kernels"),
]
OPERANDS = ("params", "grads", "codes", "masters")  # laid out one element past aligned
KEYS = Q.KEYS


@contextlib.contextmanager
def no_host_sync():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def to_cuda(x, offset=False):
    """x on the GPU (recursively through dicts and lists); offset: one element past the
    allocation's start, so no vector access is aligned."""
    if isinstance(x, dict):
        return {k: to_cuda(v, offset and k in OPERANDS) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cuda(v, offset) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    if not offset or x.dim() == 0:
        return x.to("cuda")
    out = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view(x.shape)
    return out.copy_(x)


def assert_same(g, s):
    for k in KEYS:
        assert len(g[k]) == len(s[k]), k
        for i, (a, b) in enumerate(zip(g[k], s[k])):
            assert SL.bits_equal(a.cpu().contiguous(), b.contiguous()), (k, i)


@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "offset"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in STEP_CASES])
def test_cuda_equals_cpu_kernel_bit_for_bit(case, offset):
    random.seed(0)
    torch.manual_seed(0)
    op, s, kw, run = case_state(case, 8, "cpu")
    scale, clip = run["scale"], run["clip"]
    for _ in range(3):
        SL.new_grads(s, scale or 1.0)
        extra = SL.scaler_args(s, scale, clip)
        g = to_cuda({k: s[k] for k in KEYS}, offset)
        with no_host_sync():
            Q.step(op, g, "native", **to_cuda(kw), **to_cuda(extra))
        Q.step(op, s, "native", **kw, **extra)
        assert_same(g, s)


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_skipped_step_changes_nothing(op):
    random.seed(1)
    s = Q.make_state(shapes_for(256), list(MIXED), 1, "cuda", 256, op=op)
    before = {k: [t.clone() for t in s[k]] for k in KEYS}
    extra = dict(grad_scale=torch.tensor(2.0, device="cuda"),
                 found_inf=torch.ones((), device="cuda"))
    with no_host_sync():
        Q.step(op, s, "native", master_mode=1, block_size=256, **extra)
    for k in KEYS:
        for a, b in zip(s[k], before[k]):
            assert SL.bits_equal(a, b), k
