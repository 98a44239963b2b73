"""sgd_step_ and lion_step_ on the Triton backend (interpreter on CPU; compiled where a GPU is)
against the float64 references (mpfused/reference/sgd.py, lion.py).

Tolerances (tests/tolerances.py, OP_TOL: one application of an op, per storage dtype). Each step
is compared from identical inputs (the reference runs on a copy of the kernel's state before the
step), so errors never accumulate and OP_TOL applies at every step:
* fp32 values (fp32 params and masters, joined remainders, momentum buffers, Lion moments): a
  handful of fp32 roundings where the reference rounds once from float64: OP_TOL[fp32].
* 16-bit params: the fp32 value differs by fp32 ulps, so its 16-bit rounding by at most 1 ulp.
* stochastic rounding: given the same random bits, a result differs only where the two fp32
  values straddle the threshold, so >= 99% of the elements must be bit-identical.
* Lion's sign: fp32 and float64 interpolations differ in sign only within rounding of zero (never
  with random data); sign(0) = 0 and NaN -> NaN are checked exactly (test_lion_sign_zero_and_nan).
* step counters: exact.
"""
import math
import random

import pytest
import torch

from mpfused.ops import OPS
from mpfused.reference import adam as ref
from tests.conftest import DEVICES
from tests.tolerances import TRAJ_TOL, assert_close

pytestmark = pytest.mark.skipif("triton" not in OPS["sgd_step_"].available("cpu"),
                                reason="no Triton (or TRITON_INTERPRET unset)")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NONE, FP32_MASTER, REMAINDER, STOCHASTIC = 0, 1, 2, 3
SHAPES = [(1,), (0,), (7,), (4097,), (2, 0), (5, 13)]  # odd sizes, empties, a 2-d tensor
# hyperparameters in schema order, after (params, grads, state, masters, steps)
HYPER = {
    "sgd_step_": dict(lr=1e-2, lr_tensor=None, momentum=0.9, dampening=0.0, weight_decay=0.0,
                      nesterov=False, maximize=False, master_mode=NONE),
    "lion_step_": dict(lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=0.0,
                       maximize=False, master_mode=NONE),
}
TAIL = dict(grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0,
            param_ids=[], elem_offsets=[])
KEYS = ("params", "grads", "state", "masters", "steps")


# ---- state ------------------------------------------------------------------------------------
def kernel_mode(dtype, mode):
    return ref.kernel_mode(torch.empty(0, dtype=dtype), mode)


def make_state(shapes, dtypes, mode, device, steps=None):
    """Mid-training state: random fp32 state (momentum buffers / Lion moments), masters within
    half a 16-bit ulp of their param, per-tensor step counts (0: SGD's first step)."""
    if not isinstance(dtypes, (list, tuple)):
        dtypes = [dtypes] * len(shapes)
    s = {k: [] for k in KEYS}
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        p = torch.randn(shape, device=device).to(dt)
        s["params"].append(p)
        s["state"].append(torch.randn(shape, device=device) * 0.1)
        if mode == FP32_MASTER:
            half_ulp = {F32: 0.0, F16: 2.0**-12, BF16: 2.0**-9}[dt]
            s["masters"].append(p.float() * (1 + torch.empty(shape, device=device)
                                             .uniform_(-half_ulp, half_ulp)))
        elif mode == REMAINDER:
            s["masters"].append(torch.randint(-2**15, 2**15, shape, device=device,
                                              dtype=torch.int16))
        step = steps[i] if steps is not None else random.choice([0, 1, 9])
        s["steps"].append(torch.tensor(float(step), device=device))
    new_grads(s, 1.0)
    return s


def new_grads(s, scale):
    s["grads"] = [(torch.randn_like(p, dtype=F32) * scale).to(p.dtype) for p in s["params"]]


def clone_state(s):
    return {k: [t.clone() for t in v] for k, v in s.items()}


def bits_equal(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def op_args(op, s, **kw):
    h = {**HYPER[op], **TAIL, **kw}
    uses_state = op == "lion_step_" or h["momentum"] != 0  # SGD without momentum: no buffers
    return ((s["params"], s["grads"], s["state"] if uses_state else [], s["masters"], s["steps"]),
            {k: h[k] for k in (*HYPER[op], *TAIL)})


def step(op, s, backend, **kw):
    args, kwargs = op_args(op, s, **kw)
    OPS[op](*args, **kwargs, backend=backend)


# ---- comparison -------------------------------------------------------------------------------
def assert_state_close(s, e, mode):
    """s: the kernel's state after one step, e: the reference's from the same inputs."""
    for a, b in zip(s["state"], e["state"]):
        assert_close(a, b, dtype=F32)
    for a, b in zip(s["steps"], e["steps"]):
        assert torch.equal(a, b)
    sr_total = sr_same = 0
    for i, (p, q) in enumerate(zip(s["params"], e["params"])):
        assert p.dtype == q.dtype and p.shape == q.shape
        km = kernel_mode(p.dtype, mode)
        if km == FP32_MASTER:
            assert_close(s["masters"][i], e["masters"][i], dtype=F32)
        elif km == REMAINDER:  # the fp32 master is the joined (param, remainder) pair
            assert_close(ref.remainder_join(p, s["masters"][i]),
                         ref.remainder_join(q, e["masters"][i]), dtype=F32)
        elif km == STOCHASTIC:
            sr_total += p.numel()
            sr_same += (p.view(torch.int16) == q.view(torch.int16)).sum().item()
        assert_close(p, q)  # 1 ulp of the param's dtype
    if sr_total:
        assert sr_same >= 0.99 * sr_total, f"stochastic rounding: {sr_same}/{sr_total} bit-equal"


def scaler_args(s, scale, clip):
    """grad_scale / found_inf (scale: the grads' loss scale) and fused clipping (clip: max_grad_norm
    as a multiple of the unscaled grad norm), as the optimizers pass them."""
    device = s["params"][0].device
    extra = {}
    if scale is not None:
        extra.update(grad_scale=torch.tensor(scale, device=device),
                     found_inf=torch.zeros((), device=device))
    if clip is not None:
        norm_sq = sum(((g.double() / (scale or 1.0)) ** 2).sum() for g in s["grads"])
        extra.update(norm_sq=norm_sq.float().reshape(()),
                     max_grad_norm=clip * math.sqrt(norm_sq.item()))
    return extra


def run_steps(op, s, nsteps=3, scale=None, clip=None, **kw):
    for _ in range(nsteps):
        new_grads(s, scale or 1.0)
        extra = scaler_args(s, scale, clip)
        expect = clone_state(s)
        step(op, expect, "reference", **kw, **extra)
        step(op, s, "triton", **kw, **extra)
        assert_state_close(s, expect, kw.get("master_mode", NONE))


# ---- cases: (dtypes, master mode, options); options: the op's kwargs plus lr_tensor (bool),
# scale (the grads' loss scale: grad_scale + found_inf) and clip (see scaler_args)
MIXED = (F32, BF16, F16, BF16, F32, F16)
SGD_CASES = [
    (F32, NONE, dict(momentum=0.0)),
    (F32, NONE, dict(momentum=0.9, dampening=0.1, weight_decay=0.1)),
    (F32, NONE, dict(nesterov=True, maximize=True, lr_tensor=True, scale=1024.0, clip=0.5)),
    (F32, NONE, dict(momentum=0.0, weight_decay=0.1, maximize=True, scale=65536.0)),
    (F16, NONE, dict(weight_decay=0.1)),
    (F16, FP32_MASTER, dict(nesterov=True, weight_decay=0.1, lr_tensor=True, scale=1024.0,
                            clip=0.5)),
    (F16, FP32_MASTER, dict(momentum=0.0, maximize=True, clip=0.3)),
    (BF16, NONE, dict(dampening=0.5)),
    (BF16, FP32_MASTER, dict(weight_decay=0.1, scale=8.0, clip=4.0)),  # clip inactive
    (BF16, REMAINDER, dict(nesterov=True, weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, REMAINDER, dict(momentum=0.0, maximize=True, lr_tensor=True)),
    (BF16, STOCHASTIC, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, STOCHASTIC, dict(momentum=0.0, lr_tensor=True, seed=-(2**62) - 12345)),
    (MIXED, FP32_MASTER, dict(nesterov=True, weight_decay=0.1, scale=1024.0, clip=0.5)),
    (MIXED, STOCHASTIC, dict(dampening=0.1, maximize=True, lr_tensor=True)),
]
LION_CASES = [
    (F32, NONE, dict()),
    (F32, NONE, dict(weight_decay=0.1, maximize=True, lr_tensor=True, scale=1024.0, clip=0.5)),
    (F32, NONE, dict(beta1=0.95, beta2=0.98, weight_decay=1.0, scale=65536.0)),
    (F16, NONE, dict(weight_decay=0.1)),
    (F16, FP32_MASTER, dict(weight_decay=0.1, lr_tensor=True, scale=1024.0, clip=0.5)),
    (BF16, NONE, dict(maximize=True)),
    (BF16, FP32_MASTER, dict(weight_decay=0.1, scale=8.0, clip=4.0)),  # clip inactive
    (BF16, REMAINDER, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, REMAINDER, dict(maximize=True, lr_tensor=True)),
    (BF16, STOCHASTIC, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, STOCHASTIC, dict(lr_tensor=True, seed=0x5DEECE66D)),
    (MIXED, FP32_MASTER, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (MIXED, STOCHASTIC, dict(maximize=True, lr_tensor=True, param_ids=[7, 3, 0, 12, 5, 1],
                             elem_offsets=[0, 4096, 64, 0, 1 << 40, 9])),
]
CASES = [("sgd_step_", c) for c in SGD_CASES] + [("lion_step_", c) for c in LION_CASES]


def case_id(case):
    op, (dtypes, mode, opts) = case
    dts = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    names = "+".join(dict.fromkeys(str(d).replace("torch.", "") for d in dts))
    flags = [k if v is True or isinstance(v, list) else f"{k}{v}" for k, v in opts.items()]
    return "-".join([op.split("_")[0], names, f"mode{mode}"] + flags)


def case_kwargs(op, opts, device):
    """(op kwargs, scale, clip) of a case's options."""
    kw = {k: v for k, v in opts.items() if k not in ("lr_tensor", "scale", "clip")}
    if opts.get("lr_tensor"):
        # lr is ignored when lr_tensor is given (the optimizer passes 0.0): a bogus value here
        kw.update(lr=123.0, lr_tensor=torch.tensor(2e-2, device=device))
    return kw, opts.get("scale"), opts.get("clip")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(device, case):
    op, (dtypes, mode, opts) = case
    s = make_state(SHAPES, list(dtypes) if isinstance(dtypes, tuple) else dtypes, mode, device)
    kw, scale, clip = case_kwargs(op, opts, device)
    run_steps(op, s, scale=scale, clip=clip, master_mode=mode, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,kw", [("sgd_step_", dict(nesterov=True, weight_decay=0.1)),
                                   ("lion_step_", dict(weight_decay=0.1))], ids=["sgd", "lion"])
def test_fp32_trajectory(device, op, kw):
    # 10 steps each on its own (no resync): rounding accumulates within TRAJ_TOL
    s = make_state([(300,), (5, 13)], F32, NONE, device, steps=[0, 0])
    e = clone_state(s)
    for _ in range(10):
        new_grads(s, 1.0)
        e["grads"] = [g.clone() for g in s["grads"]]
        step(op, s, "triton", **kw)
        step(op, e, "reference", **kw)
    for k in ("params", "state"):
        for a, b in zip(s[k], e[k]):
            torch.testing.assert_close(a, b, **TRAJ_TOL)


def test_sgd_first_step_takes_the_gradient(device="cpu"):
    # step counter 0: the buffer becomes the (unscaled, decayed) grad, whatever it held before;
    # counters of 1 and more: momentum * buf + (1 - dampening) * g
    s = make_state([(33,), (33,), (0,)], F32, NONE, device, steps=[0, 4, 0])
    s["state"][0].fill_(float("nan"))  # never read on a first step
    g = [x.clone() for x in s["grads"]]
    w, b = s["params"][1].clone(), s["state"][1].clone()
    step("sgd_step_", s, "triton", momentum=0.9, dampening=0.25, weight_decay=0.0,
         grad_scale=torch.tensor(4.0))
    assert torch.equal(s["state"][0], g[0] / 4)
    assert_close(s["state"][1], 0.9 * b + 0.75 * g[1] / 4)
    assert_close(s["params"][1], w - 1e-2 * s["state"][1])
    assert [t.item() for t in s["steps"]] == [1.0, 5.0, 1.0]


def test_lion_sign_zero_and_nan():
    # c = beta1 * m + (1 - beta1) * g: exactly 0 (m = g = 0) moves nothing (only the decay), and a
    # NaN gradient makes a NaN param and moment, as torch.sign, never a silent zero step.
    p = torch.tensor([1.5, -2.0, 0.25, 3.0])
    g = torch.tensor([0.0, 0.0, float("nan"), 1.0])
    m = torch.tensor([0.0, -0.0, 0.5, 0.0])
    out = {}
    for backend in ("triton", "reference"):
        s = {"params": [p.clone()], "grads": [g.clone()], "state": [m.clone()], "masters": [],
             "steps": [torch.zeros(())]}
        step("lion_step_", s, backend, weight_decay=0.5)
        out[backend] = s
    t, r = out["triton"], out["reference"]
    decay = torch.tensor(1 - 1e-2 * 0.5, dtype=torch.float64).float()
    assert torch.equal(t["params"][0][:2], p[:2] * decay)
    assert torch.isnan(t["params"][0][2]) and torch.isnan(t["state"][0][2])
    assert torch.isnan(r["params"][0][2]) and torch.isnan(r["state"][0][2])
    assert_close(t["params"][0][[0, 1, 3]], r["params"][0][[0, 1, 3]])


# ---- layouts ----------------------------------------------------------------------------------
def _strided_state(device, dtype, mode, layout):
    """One transposed param: `shared` gives every operand the param's strides (in place),
    `staged` keeps the state contiguous, `slice` is a non-dense view of a wider buffer (the kernel
    stages it and writes back)."""
    s = make_state([(9, 33)], dtype, mode, device, steps=[4])
    base = None
    if layout == "slice":
        base = torch.randn(9, 70, device=device).to(dtype)
        view = base[:, 1:67:2]
        view.copy_(s["params"][0])
        s["params"][0] = view
    else:
        s["params"][0] = s["params"][0].t().contiguous().t()
    if layout == "shared":
        for k in ("state", "masters"):
            s[k] = [t.t().contiguous().t() for t in s[k]]
    return s, base


@pytest.mark.parametrize("op", ["sgd_step_", "lion_step_"])
@pytest.mark.parametrize("layout", ["shared", "staged", "slice"])
@pytest.mark.parametrize("dtype,mode", [(F32, NONE), (BF16, FP32_MASTER), (BF16, REMAINDER),
                                        (BF16, STOCHASTIC)],
                         ids=["fp32", "bf16-master", "bf16-remainder", "bf16-stochastic"])
def test_noncontiguous(op, dtype, mode, layout, device="cpu"):
    s, base = _strided_state(device, dtype, mode, layout)
    p = s["params"][0]
    ptr, strides = p.data_ptr(), p.stride()
    outside = None if base is None else base.clone()
    for _ in range(2):
        new_grads(s, 1.0)
        s["grads"] = [g.t().contiguous().t() for g in s["grads"]]  # grads strided too
        expect = clone_state(s)
        step(op, expect, "reference", master_mode=mode, weight_decay=0.1)
        step(op, s, "triton", master_mode=mode, weight_decay=0.1)
        assert_state_close(s, expect, mode)
    assert s["params"][0].data_ptr() == ptr and s["params"][0].stride() == strides  # in place
    if base is not None:  # the slice's gaps are untouched
        untouched = torch.ones(base.shape, dtype=torch.bool, device=device)
        untouched[:, 1:67:2] = False
        assert torch.equal(base[untouched], outside[untouched])


# ---- skip, no host sync, argument checks ------------------------------------------------------
@pytest.mark.parametrize("op", ["sgd_step_", "lion_step_"])
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC],
                         ids=["master", "remainder", "stochastic"])
def test_skip_on_found_inf(op, mode, device="cpu"):
    s = make_state([(7,), (0,), (33,), (4, 5)], [F32, BF16, BF16, BF16], mode, device,
                   steps=[0, 0, 3, 1])
    s["grads"][2][3] = float("inf")
    before = clone_state(s)
    found = torch.ones(1, device=device)  # a [1] tensor, as torch's GradScaler keeps it
    step(op, s, "triton", master_mode=mode, grad_scale=torch.tensor(8.0, device=device),
         found_inf=found, norm_sq=torch.tensor(float("inf"), device=device), max_grad_norm=1.0,
         lr_tensor=torch.tensor(1e-2, device=device))
    for k in KEYS:
        for x, y in zip(s[k], before[k]):
            assert bits_equal(x, y), k
    # found_inf == 0: the step is taken and every counter advances (empty tensors' included)
    new_grads(s, 8.0)
    step(op, s, "triton", master_mode=mode, grad_scale=torch.tensor(8.0, device=device),
         found_inf=torch.zeros(1, device=device))
    for x, y in zip(s["steps"], before["steps"]):
        assert x.item() == y.item() + 1
    assert not torch.equal(s["state"][0], before["state"][0])


@pytest.mark.parametrize("op", ["sgd_step_", "lion_step_"])
def test_no_host_sync(op, monkeypatch, device="cpu"):
    # Every scalar is read on device: no .item()/bool()/float() on a tensor.
    s = make_state([(7,), (0,), (5, 3)], BF16, STOCHASTIC, device, steps=[0, 2, 5])
    kw = dict(master_mode=STOCHASTIC, lr_tensor=torch.tensor(1e-2, device=device),
              grad_scale=torch.tensor(4.0, device=device), found_inf=torch.zeros((), device=device),
              norm_sq=torch.tensor(2.0, device=device), max_grad_norm=1.0)
    expect = clone_state(s)
    step(op, expect, "reference", **kw)

    def boom(*a, **k):
        raise AssertionError("host sync in the Triton path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    try:
        step(op, s, "triton", **kw)
    finally:
        monkeypatch.undo()
    assert_state_close(s, expect, STOCHASTIC)


def test_argument_checks():
    s = make_state([(4,)], F32, NONE, "cpu")
    args, kwargs = op_args("sgd_step_", s)
    args = list(args)
    args[2] = []  # momentum 0.9 without buffers
    with pytest.raises(RuntimeError, match="momentum != 0 needs one momentum buffer per param"):
        OPS["sgd_step_"](*args, **kwargs, backend="triton")
    step("sgd_step_", {**s, "state": []}, "triton", momentum=0.0)  # no buffers needed
    with pytest.raises(RuntimeError, match=r"lion_step_: exp_avgs has 0 tensors, params 1"):
        step("lion_step_", {**s, "state": []}, "triton")
    with pytest.raises(RuntimeError, match=r"grads\[0\] must have its param's dtype"):
        step("lion_step_", {**s, "grads": [s["grads"][0].half()]}, "triton")
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[0\] must be torch.float32"):
        step("sgd_step_", {**s, "state": [s["state"][0].double()]}, "triton")
