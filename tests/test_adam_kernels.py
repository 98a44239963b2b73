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
  >= 99% of elements must be bit-identical to the reference; test_stochastic_bit_exact checks exact
  equality of the rounding itself given the same fp32 value.
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


# ---- master modes: exactness --------------------------------------------------------------------
def test_remainder_split_join_exact():
    # join(split(x)) == x for every fp32 bit pattern but NaN (inf, subnormals, -0 included), and
    # the param is x rounded to nearest bf16 with ties away from zero.
    bits = torch.randint(-2**31, 2**31, (1 << 16,), dtype=torch.int64)
    special = torch.tensor([0, -2**31, 0x7F800000, -0x00800000, 0x7FC00000, 1, 0x00008000,
                            0x3F808000, -0x407F8000, 0x7F7FFFFF, 0x7F7F8000], dtype=torch.int64)
    x = torch.cat([bits, special]).to(torch.int32).view(F32)
    p, rem = ref.remainder_split(x)
    nan = torch.isnan(x)
    assert torch.equal(ref.remainder_join(p, rem).view(torch.int32)[~nan],
                       x.view(torch.int32)[~nan])
    # every NaN is stored as the canonical quiet NaN, never rounded into -0.0 / +0.0
    assert (p.view(torch.int16)[nan] == 0x7FC0).all() and (rem[nan] == 0).all()
    finite = torch.isfinite(x) & (x.abs() < 3.3e38)
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF
    mag = (u & 0x7FFFFFFF).double()
    hi_mag = (((u >> 16) & 0x7FFF) << 16).double()
    round_up = lo >= 0x8000  # ties (0x8000) away from zero
    expect_mag = torch.where(round_up, hi_mag + 65536, hi_mag)
    got_mag = ((p.view(torch.int16).to(torch.int64) & 0x7FFF) << 16).double()
    assert torch.equal(got_mag[finite], expect_mag[finite])
    assert (mag[finite] - got_mag[finite]).abs().max() <= 32768


def test_remainder_kernel_roundtrip_exact(device, backend):
    # lr = 0, zero grads and moments: w = join(p, rem) is unchanged by the update, so the kernel's
    # join + split must give back the same (param, remainder) bits.
    n = 3000
    hi = torch.randint(-2**15, 2**15, (n,), dtype=torch.int32)
    lo = torch.randint(0, 2**16, (n,), dtype=torch.int32)
    w = ((hi << 16) | lo).view(F32)
    w = w[torch.isfinite(w) & (w != 0)].to(device)
    p, rem = ref.remainder_split(w)
    s = {"params": [p.clone()], "grads": [torch.zeros_like(p)], "exp_avgs": [torch.zeros_like(w)],
         "exp_avg_sqs": [torch.zeros_like(w)], "max_exp_avg_sqs": [], "masters": [rem.clone()],
         "steps": [torch.tensor(7.0, device=device)]}
    step(s, backend, lr=0.0, weight_decay=0.0, master_mode=REMAINDER)
    assert torch.equal(s["params"][0].view(torch.int16), p.view(torch.int16))
    assert torch.equal(s["masters"][0], rem)


def test_remainder_nan_stays_nan(device, backend):
    # A NaN master: GPU arithmetic's canonical NaN 0x7FFFFFFF (param 0x8000 + remainder -1 hold
    # it), x86's 0xFFC00000, a signaling NaN. Rounding 0x7FFFFFFF's high half up would give a
    # -0.0 param; every backend must store the canonical quiet NaN.
    p = torch.tensor([-0x8000, -0x0040, 0x7F80], dtype=torch.int16)  # 0x8000, 0xFFC0, 0x7F80
    rem = torch.tensor([-1, 0, 1], dtype=torch.int16)
    assert torch.isnan(ref.remainder_join(p.view(BF16), rem)).all()
    p = p.view(BF16).to(device)
    w = torch.zeros(3, device=device)
    s = {"params": [p.clone()], "grads": [torch.zeros_like(p)], "exp_avgs": [w.clone()],
         "exp_avg_sqs": [w.clone()], "max_exp_avg_sqs": [], "masters": [rem.to(device)],
         "steps": [torch.tensor(3.0, device=device)]}
    step(s, backend, lr=0.0, weight_decay=0.0, master_mode=REMAINDER)
    assert s["params"][0].view(torch.int16).tolist() == [0x7FC0] * 3
    assert s["masters"][0].tolist() == [0, 0, 0]


def test_remainder_equals_fp32_master(device, backend):
    # The remainder is an exact fp32 master: from the same fp32 start, modes 1 and 2 keep
    # bit-identical fp32 values and moments; params differ only at ties (lo16 == 0x8000).
    shapes = [(4097,), (0,), (7,)]
    a = make_state(shapes, BF16, REMAINDER, True, device)
    b = clone_state(a)
    b["masters"] = [ref.remainder_join(p, r) for p, r in zip(a["params"], a["masters"])]
    for _ in range(3):
        new_grads(a, 1.0)
        b["grads"] = [g.clone() for g in a["grads"]]
        step(a, backend, master_mode=REMAINDER, amsgrad=True)
        step(b, backend, master_mode=FP32_MASTER, amsgrad=True)
    for k in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"):
        for x, y in zip(a[k], b[k]):
            assert torch.equal(x, y)
    for pa, ra, pb, mb in zip(a["params"], a["masters"], b["params"], b["masters"]):
        joined = ref.remainder_join(pa, ra)
        assert torch.equal(joined.view(torch.int32), mb.view(torch.int32))
        tie = (mb.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(pa[~tie].view(torch.int16), pb[~tie].view(torch.int16))


# ---- stochastic rounding ------------------------------------------------------------------------
def _sr_expected(w32, seed, t, stream):
    idx = torch.arange(w32.numel(), device=w32.device).reshape(w32.shape)
    return ref.bf16_stochastic(w32.contiguous(), ref.random16(ref.step_seed(seed, t), stream, idx))


@pytest.mark.parametrize("keys", ["positions", "ids"])
@pytest.mark.parametrize("seed", [0, 0x5DEECE66D, -(2**62) - 12345])  # int64 (schema)
def test_stochastic_bit_exact(device, backend, seed, keys):
    # Given the same fp32 value w (the backend's own fp32-master run from identical inputs), the
    # stochastic result is exactly reference.bf16_stochastic(w, random16(step_seed(seed, t),
    # sr_stream(param_id, elem_offset), logical index)); without param_ids / elem_offsets the
    # id is the tensor's position in the call (empty tensors counted) and the offset 0.
    shapes = [(0,), (4097,), (1,), (0,), (6, 7), (7,)]
    s = make_state(shapes, BF16, STOCHASTIC, False, device, steps=[3, 0, 5, 1, 2, 8])
    s["params"][4] = s["params"][4].t().contiguous().t()  # staged (state is row-major)
    m = clone_state(s)
    m["masters"] = [p.float() for p in s["params"]]
    ids = [10 * i + 3 for i in range(len(shapes))] if keys == "ids" else []
    offsets = [17 * i for i in range(len(shapes))] if keys == "ids" else []
    kw = dict(seed=seed, param_ids=ids, elem_offsets=offsets)
    step(s, backend, master_mode=STOCHASTIC, **kw)
    step(m, backend, master_mode=FP32_MASTER, **kw)
    for i, p in enumerate(s["params"]):
        assert torch.equal(s["exp_avgs"][i], m["exp_avgs"][i])  # the same fp32 path
        if p.numel() == 0:
            continue
        t = s["steps"][i].item()
        stream = ref.sr_stream(ids[i], offsets[i]) if ids else ref.sr_stream(i)
        expect = _sr_expected(m["masters"][i], seed, t, stream)
        assert torch.equal(p.view(torch.int16), expect.view(torch.int16)), f"tensor {i}"


def test_stochastic_unbiased(device, backend):
    # 8 rows of 2048 identical elements: each element draws its own random bits, so the row mean
    # estimates E[round(w)] (= w when unbiased) with std <= 0.5 ulp / sqrt(2048) ~ 0.011 ulp.
    rows, n = 8, 2048
    p0 = (torch.randn(rows, 1) * 4).to(BF16).expand(rows, n).contiguous().to(device)
    g0 = torch.randn(rows, 1).to(BF16).expand(rows, n).contiguous().to(device)
    s = {"params": [p0.clone()], "grads": [g0], "exp_avgs": [torch.zeros(rows, n, device=device)],
         "exp_avg_sqs": [torch.zeros(rows, n, device=device)], "max_exp_avg_sqs": [],
         "masters": [], "steps": [torch.tensor(0.0, device=device)]}
    m = clone_state(s)
    m["masters"] = [p0.float()]
    kw = dict(lr=3e-3, weight_decay=0.0, seed=1234)
    step(s, backend, master_mode=STOCHASTIC, **kw)
    step(m, backend, master_mode=FP32_MASTER, **kw)
    w = m["masters"][0].double()
    out = s["params"][0].double()
    lo = ref.bf16_stochastic(m["masters"][0], torch.zeros_like(w, dtype=torch.int64)).double()
    ulp = (ref.bf16_stochastic(m["masters"][0], torch.full_like(w, 0xFFFF, dtype=torch.int64))
           .double() - lo).abs()
    assert ((out == lo) | ((out - lo).abs() == ulp)).all()  # only the two neighbours
    err = ((out.mean(1) - w[:, 0]).abs() / ulp[:, 0].clamp_min(1e-30))
    frac = ((w[:, 0] - lo[:, 0]).abs() / ulp[:, 0].clamp_min(1e-30))
    assert (err < 0.06).all(), (err, frac)
    # fresh draws every step: step 2 rounds the same value with other bits
    s2 = clone_state(s)
    s2["params"] = [p0.clone()]
    s2["steps"] = [torch.tensor(1.0, device=device)]
    step(s2, backend, master_mode=STOCHASTIC, **kw)
    moved = ulp[:, 0] > 0
    assert not torch.equal(s2["params"][0][moved], s["params"][0][moved])


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
