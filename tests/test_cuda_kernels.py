"""Native CUDA kernels (csrc/cuda via csrc/bindings/*_cuda.cpp) against mpfused.reference: the amp ops
here, adam_step_ and the CUDA graph in tests/test_cuda_adam_kernels.py (same method and helpers).

Every native call runs under torch.cuda.set_sync_debug_mode("error"): the CUDA path must never
synchronize with the host. Comparisons use the tolerances of tests/tolerances.py for a single
application of an op; multi-step Adam runs re-sync the reference state from the kernel's after each
step, so every comparison is a single application. Skipped without a GPU, or when the extension
was built without its CUDA kernels."""
import contextlib
import math

import pytest
import torch

from mpfused import _extension
from mpfused.ops import OPS
from mpfused.reference import amp as ref_amp
from tests.tolerances import OP_TOL, assert_close

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _extension.with_cuda(),
                       reason="mpfused extension built without its CUDA kernels"),
]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIXED = "mixed"
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32 partial sums vs the float64 reference
MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8 = 0, 1, 2, 3, 4
MODES = [MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8]


@contextlib.contextmanager
def no_host_sync():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def native(name, *args, **kwargs):
    with no_host_sync():
        OPS[name](*args, **kwargs, backend="native")


UPDATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale",
               "max_scale")


def update_kw(*values):
    """update_scale_'s keyword arguments from (growth, backoff, interval, hysteresis, min, max)."""
    return dict(zip(UPDATE_KEYS, values))


def scalar(x, dtype=torch.float32, device=DEV):
    return torch.tensor(x, dtype=dtype, device=device)


def with_layout(x, layout):
    """A tensor holding x's values, laid out as asked: contig; offset (contiguous, 1 element past
    an aligned address: the kernels' scalar path); strided (every other element: not dense, so the
    bindings stage it); transposed (2-D, dense but not contiguous)."""
    shape = tuple(x.shape)
    kw = {"dtype": x.dtype, "device": x.device}
    if layout == "contig":
        out = torch.empty(shape, **kw)
    elif layout == "offset":
        out = torch.empty(x.numel() + 1, **kw)[1:].view(shape)
    elif layout == "strided":
        out = torch.empty(shape[:-1] + (2 * shape[-1],), **kw)[..., ::2]
    elif layout == "transposed":
        assert len(shape) == 2
        out = torch.empty(shape[::-1], **kw).t()
    else:
        raise ValueError(layout)
    out.copy_(x)
    return out


def dtype_cycle(dtype, n, mode=None):
    """n dtypes: `dtype`, or MIXED's fp32 / fp16 / bf16 in turn. Master mode 4 (remainder8) needs
    bf16 or fp32 params (the bindings refuse fp16): MIXED is then fp32 / bf16, fp16 a skip."""
    if mode == MASTER_REMAINDER8:
        if dtype == torch.float16:
            pytest.skip("remainder8 (master mode 4) needs bf16 or fp32 params")
        if dtype == MIXED:
            return [(torch.float32, torch.bfloat16)[i % 2] for i in range(n)]
    return [DTYPES[i % 3] for i in range(n)] if dtype == MIXED else [dtype] * n


def clones(ts):
    return [t.clone() for t in ts]


# ---------------------------------------------------------------------------------------------
# check_grads / unscale_grads_
# ---------------------------------------------------------------------------------------------

SIZES = [1, 3, 17, 255, 4096, 4099, 65536, 65537, 3 * 65536 + 5, 0, 250_001]


def make_grads(sizes, dtype, layouts=("contig",), scale=8.0):
    dts = dtype_cycle(dtype, len(sizes))
    out = []
    for i, (shape, dt) in enumerate(zip(sizes, dts)):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        layout = layouts[i % len(layouts)]
        if layout == "transposed" and len(shape) != 2:
            layout = "contig"
        x = (torch.randn(shape, device=DEV) * scale).to(dt)
        out.append(with_layout(x, layout))
    return out


def run_check(grads, op, inv, found0=0.0, norm=True, per_tensor=True):
    """Runs the native op and the reference on copies; returns both sets of outputs."""
    out = {}
    ref_grads = clones(grads)  # before the native op writes the grads
    for kind in ("native", "ref"):
        gs = grads if kind == "native" else ref_grads
        found = scalar(found0)
        inv_t = scalar(inv)
        ns = scalar(1.25) if norm else None
        per = torch.linspace(0.5, 1.5, len(gs), device=DEV) if per_tensor else None
        args, kwargs = (gs, found, inv_t), dict(norm_sq=ns, norm_sq_per_tensor=per)
        if kind == "native":
            native(op, *args, **kwargs)
        else:
            getattr(ref_amp, op)(*args, **kwargs)
        out[kind] = dict(grads=gs, found=found, norm=ns, per=per)
    return out["native"], out["ref"]


@pytest.mark.parametrize("op", ["unscale_grads_", "check_grads"])
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_matches_reference(op, dtype):
    grads = make_grads(SIZES, dtype)
    before = clones(grads)
    nat, ref = run_check(grads, op, inv=1.0 / 3.0)
    assert nat["found"].item() == ref["found"].item() == 0.0
    for g, r, b in zip(nat["grads"], ref["grads"], before):
        if op == "check_grads":
            assert torch.equal(g, b), "check_grads must not write the grads"
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("layouts", [("offset",), ("strided",), ("transposed",),
                                     ("contig", "offset", "strided", "transposed")], ids=str)
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_noncontiguous(dtype, layouts):
    sizes = [(37, 129), (300, 257), (1, 5), (0, 4), (1030, 70), (2, 3)]
    grads = make_grads(sizes, dtype, layouts)
    strides = [g.stride() for g in grads]
    nat, ref = run_check(grads, "unscale_grads_", inv=0.125)
    for g, r, s in zip(nat["grads"], ref["grads"], strides):
        assert g.stride() == s  # written in place (staged tensors are copied back)
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_many_small_tensors(dtype):
    # ~1000 tensors: several launches (the per-launch tensor limit is ~130-180).
    sizes = torch.randint(0, 300, (1000,)).tolist()
    grads = make_grads(sizes, dtype)
    nat, ref = run_check(grads, "unscale_grads_", inv=0.5)
    for g, r in zip(nat["grads"], ref["grads"]):
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("norm,per_tensor", [(False, False), (True, False), (False, True)])
def test_check_optional_outputs(norm, per_tensor):
    grads = make_grads(SIZES, MIXED)
    nat, ref = run_check(grads, "unscale_grads_", inv=0.25, norm=norm, per_tensor=per_tensor)
    for g, r in zip(nat["grads"], ref["grads"]):
        assert_close(g, r, g.dtype)
    if norm:
        torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    if per_tensor:
        torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["vector", "tail", "misaligned", "small"])
@pytest.mark.parametrize("op", ["unscale_grads_", "check_grads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_found_inf(dtype, op, where, bad):
    grads = make_grads([1000, 65536 + 3, 7], dtype)
    if where == "vector":
        grads[1][12345] = bad
    elif where == "tail":
        grads[1][-1] = bad
    elif where == "misaligned":
        grads[0] = with_layout(grads[0], "offset")
        grads[0][501] = bad
    else:
        grads[2][3] = bad
    nat, ref = run_check(grads, op, inv=0.5)
    assert nat["found"].item() == ref["found"].item() == 1.0
    for g, r in zip(nat["grads"], ref["grads"]):
        rtol, atol = OP_TOL[g.dtype]
        torch.testing.assert_close(g.double(), r.double(), rtol=rtol, atol=atol, equal_nan=True)


def test_found_inf_is_never_cleared():
    grads = make_grads([100, 70000], MIXED)
    found = scalar(1.0)
    native("check_grads", grads, found, scalar(1.0))
    assert found.item() == 1.0
    found = scalar(0.0)
    native("check_grads", grads, found, scalar(1.0))
    assert found.item() == 0.0


def test_norm_is_deterministic():
    grads = make_grads([300_001, 5, 65536 * 4 + 1, 1000], MIXED)
    outs = []
    for _ in range(3):
        ns, per = scalar(0.0), torch.zeros(4, device=DEV)
        native("check_grads", grads, scalar(0.0), scalar(0.1), norm_sq=ns, norm_sq_per_tensor=per)
        outs.append((ns, per))
    for ns, per in outs[1:]:
        assert torch.equal(ns, outs[0][0]) and torch.equal(per, outs[0][1])


def test_empty_lists_and_all_empty_tensors():
    found, ns, per = scalar(0.0), scalar(2.0), torch.ones(2, device=DEV)
    native("unscale_grads_", [], found, scalar(1.0), norm_sq=ns)
    native("unscale_grads_", [torch.empty(0, device=DEV), torch.empty(0, 3, device=DEV)],
           found, scalar(1.0), norm_sq=ns, norm_sq_per_tensor=per)
    assert found.item() == 0.0 and ns.item() == 2.0 and per.tolist() == [1.0, 1.0]


def test_check_errors():
    g = [torch.randn(4, device=DEV)]
    with pytest.raises(RuntimeError, match="found_inf"):
        OPS["check_grads"](g, torch.zeros(()), scalar(1.0), backend="native")
    with pytest.raises(RuntimeError, match="norm_sq_per_tensor"):
        OPS["check_grads"](g, scalar(0.0), scalar(1.0), norm_sq=None,
                           norm_sq_per_tensor=torch.zeros(2, device=DEV),
                           backend="native")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        OPS["check_grads"]([torch.ones(3, device=DEV, dtype=torch.float64)], scalar(0.0),
                           scalar(1.0), backend="native")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 12 * 2**30,
                    reason="needs 12 GB of free GPU memory (uses ~4.3 GB)")
def test_check_beyond_int32_elements():
    n = 2**31 + 1000
    g = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    hi = 2**31 + 500
    g[hi] = 4.0
    found, ns = scalar(0.0), scalar(0.0)
    native("unscale_grads_", [g], found, scalar(0.5), norm_sq=ns)
    assert found.item() == 0.0
    assert g[0].item() == 0.5 and g[hi].item() == 2.0 and g[-1].item() == 0.5
    assert ns.item() == pytest.approx((n - 1) * 0.25 + 4.0, rel=1e-6)
    g[2**31 + 999] = float("nan")
    native("check_grads", [g], found, scalar(1.0))
    assert found.item() == 1.0
    del g
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# update_scale_
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    (2.0, 0.5, 3, 1, 0.0, math.inf),        # torch._amp_update_scale_
    (2.0, 0.5, 2, 3, 1.0, 2.0**20),         # hysteresis, min and max
    (1.5, 0.25, 1, 2, 0.0, math.inf),
])
def test_update_scale_matches_reference(cfg):
    growth, backoff, interval, hyst, mn, mx = cfg
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    nat = [scalar(2.0**16), scalar(0, torch.int32), scalar(hyst, torch.int32)]
    ref = [t.clone() for t in nat]
    for _ in range(40):
        f = float(torch.rand((), generator=gen) < 0.3)
        upd = update_kw(growth, backoff, interval, hyst, mn, mx)
        native("update_scale_", *nat, scalar(f), **upd)
        ref_amp.update_scale_(*ref, scalar(f), **upd)
        for a, b in zip(nat, ref):
            assert torch.equal(a, b)


def test_update_scale_refuses_non_finite_growth():
    s, g, h = scalar(3e38), scalar(0, torch.int32), scalar(1, torch.int32)
    native("update_scale_", s, g, h, scalar(0.0), **update_kw(2.0, 0.5, 1, 1, 0.0, math.inf))
    assert s.item() == pytest.approx(3e38) and g.item() == 0


# ---------------------------------------------------------------------------------------------
# opcheck on CUDA
# ---------------------------------------------------------------------------------------------

def test_opcheck_amp():
    grads = make_grads([5, (3, 4), 0, 70000], MIXED, ("contig", "transposed"))
    per = torch.zeros(len(grads), device=DEV)
    for op in ("unscale_grads_", "check_grads"):
        torch.library.opcheck(OPS[op].overload, (grads, scalar(0.0), scalar(0.5)),
                              dict(norm_sq=scalar(0.0), norm_sq_per_tensor=per))
    torch.library.opcheck(OPS["update_scale_"].overload,
                          (scalar(2.0**16), scalar(0, torch.int32), scalar(1, torch.int32),
                           scalar(1.0)), update_kw(2.0, 0.5, 3, 1, 0.0, math.inf))
