"""adam_step_ on every backend against the float64 reference (mpfused/reference/adam.py).

Tolerances (tests/tolerances.py, OP_TOL: one application of an op, per storage dtype). Every
comparison is of ONE step from identical inputs: before each step the reference is run on a copy
of the backend's current state, so errors never accumulate and OP_TOL applies at every step t.
* fp32 values (fp32 params, fp32 masters, joined remainder masters, exp_avg, exp_avg_sq,
  max_exp_avg_sq): the kernels do ~10 fp32 roundings per element where the reference rounds once
  from float64, a few fp32 ulps (~1e-7 relative): rtol 1e-6 (8 ulps), atol 1e-6 for values near
  zero (moments of ~1e-2, updates of ~1e-2).
* 16-bit params: the kernel's fp32 value w differs from the reference's by fp32 ulps, so its
  16-bit rounding (nearest, ties away from zero for remainders, or stochastic with the same random
  bits) can differ by at most 1 ulp of the 16-bit type: OP_TOL[fp16/bf16] is 1 ulp.
* stochastic rounding: besides 1 ulp, the same random bits must give the same result except where
  the two fp32 values straddle the threshold (probability ~ (fp32 difference)/2^16 bf16 ulp), so
  >= 99% of elements must be bit-identical to the reference; test_stochastic_bit_exact
  (tests/test_adam_master_modes.py) checks exact equality of the rounding itself given the same
  fp32 value.
* step counters: exact.
"""
import math
import os
import random

import pytest
import torch

from mpfused.ops import OPS
from mpfused.reference import adam as ref
from tests.tolerances import assert_close

OP_UNDER_TEST = "adam_step_"
KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps")
SHAPES = [(1,), (0,), (7,), (4097,), (2, 0), (5, 13)]  # odd sizes, empties, a 2-d tensor
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NONE, FP32_MASTER, REMAINDER, STOCHASTIC = 0, 1, 2, 3


# ---- state ------------------------------------------------------------------------------------
def kernel_mode(dtype, mode):
    """The mode a tensor actually gets (the CPU engine's pick_elementwise_chunk)."""
    if dtype == F32:
        return NONE
    if dtype == F16:
        return FP32_MASTER if mode == FP32_MASTER else NONE
    return mode


def make_state(shapes, dtypes, mode, amsgrad, device, steps=None):
    """Mid-training state: random moments, max_exp_avg_sq above or below exp_avg_sq, masters
    that differ from their param (within half a 16-bit ulp), per-tensor step counts."""
    if not isinstance(dtypes, (list, tuple)):
        dtypes = [dtypes] * len(shapes)
    s = {k: [] for k in KEYS}
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        p = torch.randn(shape, device=device).to(dt)
        s["params"].append(p)
        # consistent moments (|m| <= sqrt(v), as in training): updates stay below ~lr, so the
        # fp32-vs-fp64 differences of the scalars stay far below OP_TOL of the params
        m = torch.randn(shape, device=device) * 1e-2
        v = m * m * torch.empty_like(m).uniform_(1.0, 4.0) + 1e-6 * torch.rand_like(m)
        s["exp_avgs"].append(m)
        s["exp_avg_sqs"].append(v)
        if amsgrad:
            s["max_exp_avg_sqs"].append(v * torch.empty_like(v).uniform_(0.5, 1.5))
        if mode == FP32_MASTER:
            half_ulp = {F32: 0.0, F16: 2.0**-12, BF16: 2.0**-9}[dt]
            s["masters"].append(p.float() * (1 + torch.empty_like(v).uniform_(-half_ulp, half_ulp)))
        elif mode == REMAINDER:
            s["masters"].append(torch.randint(-2**15, 2**15, shape, device=device, dtype=torch.int16))
            # (+0, a negative remainder) is no master (its fp32 bits are a NaN's): randn draws an
            # exact 0 once in ~2**24
            s["masters"][-1][s["params"][-1] == 0] = 0
        step = steps[i] if steps is not None else random.choice([0, 1, 9, 99])
        s["steps"].append(torch.tensor(float(step), device=device))
    new_grads(s, 1.0)
    return s


def new_grads(s, scale):
    s["grads"] = [(torch.randn_like(p, dtype=F32) * scale).to(p.dtype) for p in s["params"]]


def bits_equal(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def clone_state(s):
    return {k: [t.clone() for t in v] for k, v in s.items()}


HYPER = dict(lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
             amsgrad=False, maximize=False, decoupled=True, master_mode=NONE, grad_scale=None,
             found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=[], elem_offsets=[])
ARG_ORDER = ("lr", "lr_tensor", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize",
             "decoupled", "master_mode", "grad_scale", "found_inf", "norm_sq", "max_grad_norm", "seed",
             "param_ids", "elem_offsets")


def op_args(s, **kw):
    """(operands, keyword arguments) of an adam_step_ call."""
    h = {**HYPER, **kw}
    return tuple(s[k] for k in KEYS), {k: h[k] for k in ARG_ORDER}


def step(s, backend, **kw):
    args, kwargs = op_args(s, **kw)
    OPS["adam_step_"](*args, **kwargs, backend=backend)


# ---- comparison -------------------------------------------------------------------------------
FP32_TOL = dict(dtype=F32)  # OP_TOL[fp32]: rtol 1e-6, atol 1e-6


def assert_state_close(s, e, mode):
    """s: a backend's state after one step, e: the reference's from the same inputs."""
    for k in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        for a, b in zip(s[k], e[k]):
            assert_close(a, b, **FP32_TOL)
    for a, b in zip(s["steps"], e["steps"]):
        assert torch.equal(a, b)
    sr_total = sr_same = 0
    for i, (p, q) in enumerate(zip(s["params"], e["params"])):
        assert p.dtype == q.dtype and p.shape == q.shape
        km = kernel_mode(p.dtype, mode)
        if km == FP32_MASTER:
            assert_close(s["masters"][i], e["masters"][i], **FP32_TOL)
        elif km == REMAINDER:
            # The fp32 master is the joined (param, remainder) pair.
            assert_close(ref.remainder_join(p, s["masters"][i]),
                         ref.remainder_join(q, e["masters"][i]), **FP32_TOL)
        elif km == STOCHASTIC:
            sr_total += p.numel()
            sr_same += (p.view(torch.int16) == q.view(torch.int16)).sum().item()
        assert_close(p, q)  # 1 ulp of the param's dtype (exact for fp32 within OP_TOL)
    if sr_total:
        assert sr_same >= 0.99 * sr_total, f"stochastic rounding: {sr_same}/{sr_total} bit-equal"


def run_steps(s, backend, nsteps=3, grad_scale=None, clip=None, **kw):
    """nsteps steps of `backend`, each compared with the reference from the same inputs. clip:
    max_grad_norm as a multiple of the (unscaled) grad norm."""
    device = s["params"][0].device
    for _ in range(nsteps):
        scale = 1.0 if grad_scale is None else grad_scale
        new_grads(s, scale)
        extra = {}
        if grad_scale is not None:
            extra["grad_scale"] = torch.tensor(scale, device=device)
            extra["found_inf"] = torch.zeros((), device=device)
        if clip is not None:
            norm_sq = sum(((g.double() / scale) ** 2).sum() for g in s["grads"])
            extra["norm_sq"] = norm_sq.float().reshape(())
            extra["max_grad_norm"] = clip * math.sqrt(norm_sq.item())
        expect = clone_state(s)
        step(expect, "reference", **kw, **extra)
        step(s, backend, **kw, **extra)
        assert_state_close(s, expect, kw.get("master_mode", NONE))


# (dtypes, master_mode, amsgrad, maximize, decoupled, weight_decay, tensor lr, grad_scale, clip)
CASES = [
    (F32, NONE, False, False, True, 0.1, False, None, None),
    (F32, NONE, True, True, False, 0.1, True, 1024.0, 0.5),
    (F32, NONE, False, False, False, 0.0, False, 65536.0, None),
    (F16, NONE, False, False, True, 0.1, False, None, None),
    (F16, FP32_MASTER, True, False, True, 0.1, True, 1024.0, 0.5),
    (F16, FP32_MASTER, False, True, False, 0.1, False, None, 0.3),
    (BF16, NONE, True, False, False, 0.1, False, None, None),
    (BF16, FP32_MASTER, False, False, True, 0.1, False, 8.0, 4.0),  # clip inactive
    (BF16, FP32_MASTER, True, True, False, 0.0, True, None, 0.5),
    (BF16, REMAINDER, False, False, True, 0.1, False, 1024.0, 0.5),
    (BF16, REMAINDER, True, True, False, 0.1, True, None, None),
    (BF16, STOCHASTIC, False, False, True, 0.1, False, 1024.0, 0.5),
    (BF16, STOCHASTIC, True, False, False, 0.0, True, None, None),
    # one call over mixed dtypes: fp32 params ignore the master, fp16 and bf16 use it
    ((F32, BF16, F16, BF16, F32, F16), FP32_MASTER, True, False, True, 0.1, False, 1024.0, 0.5),
    ((F32, BF16, BF16, BF16, F32, BF16), STOCHASTIC, False, True, True, 0.1, True, None, None),
]


def case_id(c):
    dt = c[0] if isinstance(c[0], tuple) else (c[0],)
    names = "+".join(dict.fromkeys(str(d).replace("torch.", "") for d in dt))
    flags = [f"mode{c[1]}", "ams" if c[2] else "", "max" if c[3] else "", "adamw" if c[4] else "adam",
             f"wd{c[5]}", "lrT" if c[6] else "", f"scale{c[7]:g}" if c[7] else "",
             f"clip{c[8]}" if c[8] else ""]
    return "-".join([names] + [f for f in flags if f])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(device, backend, case):
    dtypes, mode, ams, maximize, decoupled, wd, lr_t, scale, clip = case
    dtypes = list(dtypes) if isinstance(dtypes, tuple) else dtypes
    s = make_state(SHAPES, dtypes, mode, ams, device)
    kw = dict(master_mode=mode, amsgrad=ams, maximize=maximize, decoupled=decoupled,
              weight_decay=wd)
    if lr_t:
        # lr is ignored when lr_tensor is given (the optimizer passes 0.0): a bogus value here
        kw.update(lr=123.0, lr_tensor=torch.tensor(2e-2, device=device))
    run_steps(s, backend, grad_scale=scale, clip=clip, **kw)


def test_many_small_tensors(device, backend):
    # 200 tensors in one call, some empty: per-tensor steps and the stochastic-rounding slot
    # (index among the non-empty tensors) must line up across backends.
    shapes = [(random.choice([0, 1, 2, 3, 5, 8, 17]),) for _ in range(200)]
    dtypes = [random.choice([F32, BF16, BF16]) for _ in shapes]
    s = make_state(shapes, dtypes, STOCHASTIC, True, device)
    run_steps(s, backend, nsteps=1, master_mode=STOCHASTIC, amsgrad=True,
              grad_scale=512.0, clip=0.5)


# ---- non-contiguous params ----------------------------------------------------------------------
def _strided_state(device, dtype, mode, layout):
    """One transposed param (and a slice of a wider buffer for `slice`): `shared` gives every
    operand the param's strides (what zeros_like(p) gives an optimizer), `staged` keeps the state
    contiguous, `slice` is a non-dense view (the kernel must stage and write back)."""
    s = make_state([(9, 33)], dtype, mode, True, device, steps=[4])
    base = None
    if layout == "slice":
        base = torch.randn(9, 70, device=device).to(dtype)
        view = base[:, 1:67:2]
        view.copy_(s["params"][0])
        s["params"][0] = view
    else:
        s["params"][0] = s["params"][0].t().contiguous().t()
    if layout == "shared":
        for k in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters"):
            s[k] = [t.t().contiguous().t() for t in s[k]]
    return s, base


@pytest.mark.parametrize("layout", ["shared", "staged", "slice"])
@pytest.mark.parametrize("dtype,mode", [(F32, NONE), (BF16, FP32_MASTER), (BF16, REMAINDER),
                                        (BF16, STOCHASTIC)],
                         ids=["fp32", "bf16-master", "bf16-remainder", "bf16-stochastic"])
def test_noncontiguous(device, backend, dtype, mode, layout):
    s, base = _strided_state(device, dtype, mode, layout)
    p = s["params"][0]
    ptr, strides = p.data_ptr(), p.stride()
    outside = None if base is None else base.clone()
    for _ in range(2):
        new_grads(s, 1.0)
        s["grads"] = [g.t().contiguous().t() for g in s["grads"]]  # grads strided too
        expect = clone_state(s)
        step(expect, "reference", master_mode=mode, amsgrad=True)
        step(s, backend, master_mode=mode, amsgrad=True)
        assert_state_close(s, expect, mode)
        if mode == STOCHASTIC:  # logical order: bit-equal to the reference almost everywhere
            same = (s["params"][0].view(torch.int16) == expect["params"][0].view(torch.int16))
            assert same.float().mean().item() >= 0.99
    assert s["params"][0].data_ptr() == ptr and s["params"][0].stride() == strides  # in place
    if base is not None:  # the slice's gaps are untouched
        untouched = torch.ones(base.shape, dtype=torch.bool, device=device)
        untouched[:, 1:67:2] = False
        assert torch.equal(base[untouched], outside[untouched])


# ---- skip on found_inf, step counters -----------------------------------------------------------
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC],
                         ids=["master", "remainder", "stochastic"])
def test_skip_on_found_inf(device, backend, mode):
    dtypes = [F32, BF16, BF16, BF16]
    s = make_state([(7,), (0,), (33,), (4, 5)], dtypes, mode, True, device)
    s["grads"][2][3] = float("inf")
    before = clone_state(s)
    found = torch.ones(1, device=device)  # a [1] tensor, as torch's GradScaler keeps it
    step(s, backend, master_mode=mode, amsgrad=True, grad_scale=torch.tensor(8.0, device=device),
         found_inf=found, norm_sq=torch.tensor(float("inf"), device=device), max_grad_norm=1.0)
    for k in KEYS:
        for x, y in zip(s[k], before[k]):
            assert bits_equal(x, y), k
    # found_inf == 0: the step is taken and every counter advances (empty tensors' included)
    new_grads(s, 8.0)
    step(s, backend, master_mode=mode, amsgrad=True, grad_scale=torch.tensor(8.0, device=device),
         found_inf=torch.zeros(1, device=device))
    for x, y in zip(s["steps"], before["steps"]):
        assert x.item() == y.item() + 1
    assert not torch.equal(s["exp_avgs"][0], before["exp_avgs"][0])


def test_triton_no_host_sync(device, backend, monkeypatch):
    # The Triton path reads every scalar on device: no .item()/bool()/float() on a tensor.
    if backend != "triton":
        pytest.skip("Triton-specific")
    s = make_state([(7,), (0,), (5, 3)], BF16, STOCHASTIC, True, device)
    kw = dict(master_mode=STOCHASTIC, amsgrad=True, lr_tensor=torch.tensor(1e-2, device=device),
              grad_scale=torch.tensor(4.0, device=device), found_inf=torch.zeros((), device=device),
              norm_sq=torch.tensor(2.0, device=device), max_grad_norm=1.0)
    expect = clone_state(s)
    step(expect, "reference", **kw)

    def boom(*a, **k):
        raise AssertionError("host sync in the Triton path")

    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    else:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, boom)
    try:
        step(s, backend, **kw)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    assert_state_close(s, expect, STOCHASTIC)


# ---- dispatcher / torch.library ----------------------------------------------------------------
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER], ids=["master", "remainder"])
def test_opcheck(mode):
    s = make_state([(7,), (0,), (3, 5)], BF16, mode, True, "cpu")
    args, kwargs = op_args(s, master_mode=mode, amsgrad=True, lr_tensor=torch.tensor(1e-3),
                           grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()),
                           norm_sq=torch.tensor(4.0), max_grad_norm=1.0, seed=3)
    torch.library.opcheck(OPS["adam_step_"].overload, args, kwargs)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
