"""sgd_step_ and lion_step_ native kernels against their float64 references
(mpfused/reference/sgd.py, lion.py), and SGD against torch.optim.SGD.

As in tests/test_adam_kernels.py, every comparison is of ONE step from identical inputs (the
reference runs on a copy of the kernel's state before each step), so tolerances never compound:
OP_TOL of tests/tolerances.py (fp32 values a few ulps, 16-bit params 1 ulp, stochastic rounding
>= 99% bit-equal and exactly equal given the same fp32 value). Lion's sign(c) is compared only
where c is clear of 0 (LION_SIGN_RTOL). Native backends only (other backends of these ops are
tested beside their kernels); devices without a native kernel are skipped.
"""
import math
import random

import pytest
import torch

from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from mpfused.reference import adam as ref
from tests.conftest import DEVICES
from tests.test_adam_kernels import (BF16, F16, F32, FP32_MASTER, NONE, REMAINDER, SHAPES,
                                     STOCHASTIC, bits_equal, clone_state, kernel_mode)
from tests.test_adam_master_modes import _sr_expected
from tests.test_bound_ops import _NoPlainCall
from tests.tolerances import LION_SIGN_RTOL, assert_close

TAIL = dict(master_mode=NONE, grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0,
            seed=0, param_ids=[], elem_offsets=[])


class Spec:
    """An op's operand lists (its state list is the third) and its scalar arguments in order."""

    def __init__(self, name, state, head):
        self.name, self.state = name, state
        self.keys = ("params", "grads", state, "masters", "steps")
        self.hyper = {**head, **TAIL}
        self.order = tuple(head) + tuple(TAIL)


SGD = Spec("sgd_step_", "momentum_buffers", dict(
    lr=1e-2, lr_tensor=None, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
    maximize=False))
LION = Spec("lion_step_", "exp_avgs", dict(
    lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False))
SPECS = {"sgd": SGD, "lion": LION}


@pytest.fixture(params=DEVICES)
def dev(request):
    for spec in SPECS.values():
        if not OPS[spec.name].native_available(request.param):
            pytest.skip(f"no native {spec.name} kernel for {request.param} in this build")
    return request.param


# ---- state and calls --------------------------------------------------------------------------
def make_state(spec, shapes, dtypes, mode, device, steps=None, stateless=False):
    """Mid-training state: fp32 state of ~0.1, masters within half a 16-bit ulp of their param
    (or random remainders), per-tensor step counts (0: SGD's first step)."""
    dtypes = dtypes if isinstance(dtypes, (list, tuple)) else [dtypes] * len(shapes)
    s = {k: [] for k in spec.keys}
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        p = torch.randn(shape, device=device).to(dt)
        s["params"].append(p)
        if not stateless:
            s[spec.state].append(torch.randn(shape, device=device) * 0.1)
        if mode == FP32_MASTER:
            half_ulp = {F32: 0.0, F16: 2.0**-12, BF16: 2.0**-9}[dt]
            s["masters"].append(p.float() * (1 + torch.rand(shape, device=device).sub(0.5)
                                             .mul(2 * half_ulp)))
        elif mode == REMAINDER:
            s["masters"].append(torch.randint(-2**15, 2**15, shape, dtype=torch.int16).to(device))
        step = steps[i] if steps is not None else random.choice([0, 1, 9, 99])
        s["steps"].append(torch.tensor(float(step), device=device))
    new_grads(s, 1.0)
    return s


def new_grads(s, scale):
    s["grads"] = [(torch.randn_like(p, dtype=F32) * scale).to(p.dtype) for p in s["params"]]


def op_args(spec, s, **kw):
    """(operands, keyword arguments) of the op's call."""
    h = {**spec.hyper, **kw}
    return tuple(s[k] for k in spec.keys), {k: h[k] for k in spec.order}


def step(spec, s, backend="native", **kw):
    args, kwargs = op_args(spec, s, **kw)
    OPS[spec.name](*args, **kwargs, backend=backend)


def lion_ambiguous(s, kw):
    """Per param: where c = b1*m + (1-b1)*g is too close to 0 for fp32 and float64 to agree on
    its sign (a 2*lr difference in w, not an error)."""
    h = {**LION.hyper, **kw}
    mult = ref.grad_multiplier(h["grad_scale"], h["norm_sq"], h["max_grad_norm"])
    out = []
    for m, g in zip(s["exp_avgs"], s["grads"]):
        a, b = h["beta1"] * m.double(), (1 - h["beta1"]) * mult * g.double()
        out.append((a + b).abs() <= LION_SIGN_RTOL * (a.abs() + b.abs()))
    return out


def assert_state_close(spec, s, e, mode, skip=None):
    """s: the kernel's state after one step, e: the reference's from the same inputs; skip[i]:
    elements of param i left out of the param comparison."""
    for a, b in zip(s[spec.state], e[spec.state]):
        assert_close(a, b, dtype=F32)
    for a, b in zip(s["steps"], e["steps"]):
        assert torch.equal(a, b)
    sr_total = sr_same = 0
    for i, (p, q) in enumerate(zip(s["params"], e["params"])):
        keep = ~skip[i] if skip is not None else torch.ones_like(p, dtype=torch.bool)
        km = kernel_mode(p.dtype, mode)
        if km == FP32_MASTER:
            assert_close(s["masters"][i][keep], e["masters"][i][keep], dtype=F32)
        elif km == REMAINDER:
            assert_close(ref.remainder_join(p, s["masters"][i])[keep],
                         ref.remainder_join(q, e["masters"][i])[keep], dtype=F32)
        elif km == STOCHASTIC:
            sr_total += int(keep.sum())
            sr_same += int((p.view(torch.int16) == q.view(torch.int16))[keep].sum())
        assert_close(p[keep], q[keep], dtype=p.dtype)
    assert sr_same >= 0.99 * sr_total, f"stochastic rounding: {sr_same}/{sr_total} bit-equal"


def assert_bits_equal(spec, a, b):
    assert all(bits_equal(x, y) for k in spec.keys for x, y in zip(a[k], b[k]))


def run_steps(spec, s, nsteps=3, grad_scale=None, clip=None, **kw):
    """nsteps native steps, each compared with the reference from the same inputs. clip:
    max_grad_norm as a multiple of the unscaled grad norm."""
    device = s["params"][0].device
    for _ in range(nsteps):
        scale = 1.0 if grad_scale is None else grad_scale
        new_grads(s, scale)
        extra = {}
        if grad_scale is not None:
            extra.update(grad_scale=torch.tensor(scale, device=device),
                         found_inf=torch.zeros((), device=device))
        if clip is not None:
            norm_sq = sum(((g.double() / scale) ** 2).sum() for g in s["grads"])
            extra.update(norm_sq=norm_sq.float().reshape(()),
                         max_grad_norm=clip * math.sqrt(norm_sq.item()))
        step_and_compare(spec, s, **kw, **extra)


def step_and_compare(spec, s, **kw):
    """One native step, compared with the reference's from the same inputs."""
    skip = lion_ambiguous(s, kw) if spec is LION else None
    expect = clone_state(s)
    step(spec, expect, "reference", **kw)
    step(spec, s, **kw)
    assert_state_close(spec, s, expect, kw.get("master_mode", NONE), skip)


# ---- against the reference ----------------------------------------------------------------------
MIXED = (F32, BF16, F16, BF16, F32, F16)
# (op, dtypes, master_mode, op hyperparameters (lr_tensor=True: a tensor lr), grad_scale, clip)
CASES = [
    ("sgd", F32, NONE, dict(momentum=0.0), None, None),
    ("sgd", F32, NONE, dict(weight_decay=0.1), 1024.0, 0.5),
    ("sgd", F32, NONE, dict(dampening=0.3, nesterov=True, maximize=True, lr_tensor=True), None,
     None),
    ("sgd", F16, NONE, dict(dampening=0.1), None, None),
    ("sgd", F16, FP32_MASTER, dict(nesterov=True, weight_decay=0.1), 1024.0, 0.5),
    ("sgd", BF16, NONE, dict(momentum=0.0, weight_decay=0.1, maximize=True), None, None),
    ("sgd", BF16, FP32_MASTER, dict(dampening=0.1), 8.0, 4.0),  # clip inactive
    ("sgd", BF16, REMAINDER, dict(nesterov=True, lr_tensor=True), 1024.0, 0.5),
    ("sgd", BF16, STOCHASTIC, dict(weight_decay=0.1, maximize=True), None, 0.5),
    ("sgd", BF16, STOCHASTIC, dict(momentum=0.0, lr_tensor=True), 65536.0, None),
    ("sgd", MIXED, FP32_MASTER, dict(weight_decay=0.1), 1024.0, 0.5),
    ("lion", F32, NONE, dict(), None, None),
    ("lion", F32, NONE, dict(weight_decay=0.1, maximize=True, lr_tensor=True), 1024.0, 0.5),
    ("lion", F16, NONE, dict(beta1=0.95, beta2=0.98), None, None),
    ("lion", F16, FP32_MASTER, dict(weight_decay=0.1), 1024.0, 0.5),
    ("lion", BF16, NONE, dict(maximize=True), None, None),
    ("lion", BF16, FP32_MASTER, dict(weight_decay=0.1, lr_tensor=True), 8.0, 4.0),
    ("lion", BF16, REMAINDER, dict(beta1=0.0, beta2=0.9), 1024.0, 0.5),
    ("lion", BF16, STOCHASTIC, dict(weight_decay=0.1), None, 0.5),
    ("lion", MIXED, STOCHASTIC, dict(maximize=True), 1024.0, None),
]


def case_id(c):
    dt = c[1] if isinstance(c[1], tuple) else (c[1],)
    names = "+".join(dict.fromkeys(str(d).replace("torch.", "") for d in dt))
    flags = [f"{k[:4]}{v}" for k, v in c[3].items()]
    flags += [f"scale{c[4]:g}" if c[4] else "", f"clip{c[5]}" if c[5] else ""]
    return "-".join([c[0], names, f"mode{c[2]}"] + [f for f in flags if f])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(dev, case):
    op, dtypes, mode, hyper, scale, clip = case
    spec, kw = SPECS[op], dict(hyper, master_mode=mode)
    dtypes = list(dtypes) if isinstance(dtypes, tuple) else dtypes
    s = make_state(spec, SHAPES, dtypes, mode, dev, stateless=kw.get("momentum") == 0.0)
    if kw.pop("lr_tensor", False):  # the op ignores lr when lr_tensor is given: a bogus lr here
        kw.update(lr=123.0, lr_tensor=torch.tensor(2e-2, device=dev))
    run_steps(spec, s, grad_scale=scale, clip=clip, **kw)


@pytest.mark.parametrize("op", ["sgd", "lion"])
def test_many_small_tensors(dev, op):
    # 200 tensors in one call, some empty: per-tensor steps (SGD's first step included) and the
    # stochastic-rounding keys must line up with the reference's.
    shapes = [(random.choice([0, 1, 2, 3, 5, 8, 17]),) for _ in range(200)]
    dtypes = [random.choice([F32, BF16, BF16]) for _ in shapes]
    s = make_state(SPECS[op], shapes, dtypes, STOCHASTIC, dev)
    run_steps(SPECS[op], s, nsteps=1, master_mode=STOCHASTIC, grad_scale=512.0, clip=0.5,
              weight_decay=0.1)


@pytest.mark.parametrize("layout", ["shared", "staged", "slice"])
@pytest.mark.parametrize("dtype,mode", [(F32, NONE), (BF16, REMAINDER), (BF16, STOCHASTIC)],
                         ids=["fp32", "bf16-remainder", "bf16-stochastic"])
@pytest.mark.parametrize("op", ["sgd", "lion"])
def test_noncontiguous(dev, op, dtype, mode, layout):
    # A transposed param whose state shares its strides (used in place), or has contiguous state
    # (staged), or a non-dense slice of a wider buffer (staged and written back, gaps untouched).
    spec = SPECS[op]
    s = make_state(spec, [(9, 33)], dtype, mode, dev, steps=[4])
    base = outside = None
    if layout == "slice":
        base = torch.randn(9, 70, device=dev).to(dtype)
        base[:, 1:67:2] = s["params"][0]
        s["params"][0], outside = base[:, 1:67:2], base.clone()
    else:
        s["params"][0] = s["params"][0].t().contiguous().t()
    if layout == "shared":
        for k in (spec.state, "masters"):
            s[k] = [t.t().contiguous().t() for t in s[k]]
    ptr = s["params"][0].data_ptr()
    for _ in range(2):
        new_grads(s, 1.0)
        s["grads"] = [g.t().contiguous().t() for g in s["grads"]]
        step_and_compare(spec, s, master_mode=mode)
    assert s["params"][0].data_ptr() == ptr
    if base is not None:
        gaps = torch.ones(base.shape, dtype=torch.bool, device=dev)
        gaps[:, 1:67:2] = False
        assert torch.equal(base[gaps], outside[gaps])


# ---- SGD specifics ------------------------------------------------------------------------------
@pytest.mark.parametrize("dampening,weight_decay", [(0.0, 0.0), (0.5, 0.0), (0.5, 0.1)])
def test_sgd_first_step_buffer_is_the_gradient(dev, dampening, weight_decay):
    # t == 1: buf = g itself (torch clones it), dampening not applied and the old buffer (here NaN
    # garbage) never read; later tensors in the same call at t > 1 use theirs.
    s = make_state(SGD, [(5, 7), (300,), (4,)], F32, NONE, dev, steps=[0, 0, 6])
    for b in s["momentum_buffers"][:2]:
        b.fill_(float("nan"))
    old = s["momentum_buffers"][2].clone()
    p0 = [p.clone() for p in s["params"]]
    step(SGD, s, dampening=dampening, weight_decay=weight_decay, lr=0.1)
    g = [gi + weight_decay * pi if weight_decay else gi for gi, pi in zip(s["grads"], p0)]
    for i in range(2):
        if weight_decay:
            assert_close(s["momentum_buffers"][i], g[i], dtype=F32)
        else:  # torch clones the gradient: bit for bit
            assert torch.equal(s["momentum_buffers"][i], g[i])
    assert_close(s["momentum_buffers"][2], 0.9 * old + (1 - dampening) * g[2], dtype=F32)
    assert all(torch.isfinite(p).all() for p in s["params"])


# OP_TOL fp32 after 4 steps (measured: |diff| - 1e-6 |p| <= 3e-8, atol 1e-6): torch's
# add_(alpha=) fuses multiply and add (one rounding) where the kernels never contract (the
# bit-exact CPU = CUDA contract), an ulp apart per step.
TORCH_SGD_TOL = dict(dtype=F32)
TORCH_SGD = [(0.0, 0.0, False, 0.0, False), (0.9, 0.0, False, 0.01, False),
             (0.9, 0.3, False, 0.0, True), (0.9, 0.0, True, 0.01, False),
             (0.5, 0.0, True, 0.1, True)]


@pytest.mark.parametrize("momentum,dampening,nesterov,wd,maximize", TORCH_SGD)
def test_sgd_matches_torch_optim(momentum, dampening, nesterov, wd, maximize):
    # fp32 params over 4 steps against torch.optim.SGD's for-loop, both fp32 in torch's order.
    hyper = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                 weight_decay=wd, maximize=maximize)
    shapes = [(7,), (33, 5), (0,), (1000,)]
    # step 0: the buffers' random values are never read (t == 1 starts them from the gradient)
    s = make_state(SGD, shapes, F32, NONE, "cpu", steps=[0] * 4, stateless=momentum == 0)
    tp = [p.clone().requires_grad_() for p in s["params"]]
    opt = torch.optim.SGD(tp, foreach=False, **hyper)
    for _ in range(4):
        new_grads(s, 1.0)
        for p, g in zip(tp, s["grads"]):
            p.grad = g.clone()
        opt.step()
        step(SGD, s, **hyper)
    for i, p in enumerate(tp):
        assert_close(s["params"][i], p.detach(), **TORCH_SGD_TOL)
        if momentum:
            assert_close(s["momentum_buffers"][i], opt.state[p]["momentum_buffer"], **TORCH_SGD_TOL)


# ---- skip, NaN, stochastic rounding -------------------------------------------------------------
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC])
@pytest.mark.parametrize("op", ["sgd", "lion"])
def test_skip_on_found_inf(dev, op, mode):
    spec = SPECS[op]
    s = make_state(spec, [(7,), (0,), (33,), (4, 5)], [F32, BF16, BF16, BF16], mode, dev)
    s["grads"][2][3] = float("inf")
    before = clone_state(s)
    step(spec, s, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=torch.ones(1, device=dev), norm_sq=torch.tensor(float("inf"), device=dev),
         max_grad_norm=1.0, weight_decay=0.1)
    assert_bits_equal(spec, s, before)
    new_grads(s, 8.0)  # found_inf == 0: taken, every counter advances (the empty one's too)
    step(spec, s, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=torch.zeros(1, device=dev))
    assert [x.item() for x in s["steps"]] == [y.item() + 1 for y in before["steps"]]
    assert not torch.equal(s[spec.state][0], before[spec.state][0])


@pytest.mark.parametrize("dtype,mode", [(F32, NONE), (F16, NONE), (F16, FP32_MASTER),
                                        (BF16, FP32_MASTER), (BF16, REMAINDER), (BF16, STOCHASTIC)])
@pytest.mark.parametrize("op", ["sgd", "lion"])
def test_nan_propagates(dev, op, dtype, mode):
    # A NaN gradient element shows as NaN in its param (and master) and state, never as a silent
    # finite value; the other elements stay finite.
    spec = SPECS[op]
    s = make_state(spec, [(40,)], dtype, mode, dev, steps=[3])
    s["grads"][0][5] = float("nan")
    step(spec, s, master_mode=mode, weight_decay=0.1)
    p = s["params"][0].float()
    assert torch.isnan(p[5]) and torch.isnan(s[spec.state][0][5])
    if mode == FP32_MASTER:
        assert torch.isnan(s["masters"][0][5])
    if mode == REMAINDER:
        assert torch.isnan(ref.remainder_join(s["params"][0], s["masters"][0])[5])
    others = torch.arange(40, device=dev) != 5
    assert torch.isfinite(p[others]).all() and torch.isfinite(s[spec.state][0][others]).all()


@pytest.mark.parametrize("keys", ["positions", "ids"])
@pytest.mark.parametrize("op", ["sgd", "lion"])
def test_stochastic_bit_exact(dev, op, keys):
    # Given the same fp32 value w (the kernel's own fp32-master run from identical inputs), the
    # bf16 param is exactly reference.bf16_stochastic(w, random16(step_seed(seed, t),
    # sr_stream(param_id, elem_offset), logical index)).
    spec, seed = SPECS[op], 0x5DEECE66D
    shapes = [(0,), (4097,), (1,), (6, 7), (7,)]
    s = make_state(spec, shapes, BF16, STOCHASTIC, dev, steps=[3, 0, 5, 2, 8])
    s["params"][3] = s["params"][3].t().contiguous().t()  # staged: SR follows the logical order
    m = clone_state(s)
    m["masters"] = [p.float() for p in s["params"]]
    ids = [10 * i + 3 for i in range(len(shapes))] if keys == "ids" else []
    offsets = [17 * i for i in range(len(shapes))] if keys == "ids" else []
    kw = dict(seed=seed, param_ids=ids, elem_offsets=offsets, weight_decay=0.1)
    step(spec, s, master_mode=STOCHASTIC, **kw)
    step(spec, m, master_mode=FP32_MASTER, **kw)
    for i, p in enumerate(s["params"]):
        assert torch.equal(s[spec.state][i], m[spec.state][i])  # the same fp32 path
        if p.numel():
            stream = ref.sr_stream(ids[i], offsets[i]) if ids else ref.sr_stream(i)
            expect = _sr_expected(m["masters"][i], seed, s["steps"][i].item(), stream)
            assert torch.equal(p.view(torch.int16), expect.view(torch.int16)), f"tensor {i}"


# ---- arguments, dispatcher, BoundOp -------------------------------------------------------------
BAD = [  # (op, list, index (None: the whole list), its replacement, message)
    ("sgd", "momentum_buffers", None, lambda x: [], "one momentum buffer per param"),
    ("sgd", "momentum_buffers", 1, lambda x: x.double(), r"momentum_buffers\[1\] must be"),
    ("lion", "exp_avgs", 0, lambda x: x.half(), r"exp_avgs\[0\] must be"),
    ("lion", "exp_avgs", None, lambda x: x[:1], "same length"),
    ("sgd", "grads", 0, lambda x: x.float(), r"grads\[0\] must have"),
    ("lion", "steps", 1, lambda x: x.double(), r"steps\[1\] must be a 1-element"),
    ("sgd", "masters", None, lambda x: [], "needs one master per param"),
    ("lion", "masters", 0, lambda x: x.half(), r"masters\[0\] must be"),
]


@pytest.mark.parametrize("op,key,index,bad,msg", BAD, ids=[f"{b[0]}-{b[1]}-{b[2]}" for b in BAD])
def test_bad_arguments_rejected_before_any_change(dev, op, key, index, bad, msg):
    spec = SPECS[op]
    s = make_state(spec, [(7,), (3, 4)], BF16, FP32_MASTER, dev)
    if index is None:
        s[key] = bad(s[key])
    else:
        s[key][index] = bad(s[key][index])
    before = clone_state(s)
    with pytest.raises(RuntimeError, match=msg):
        step(spec, s, master_mode=FP32_MASTER)
    assert_bits_equal(spec, s, before)


@pytest.mark.parametrize("op,kw", [("sgd", dict(momentum=0.0)), ("sgd", dict(nesterov=True)),
                                   ("lion", dict())], ids=["sgd-plain", "sgd-nesterov", "lion"])
def test_opcheck(op, kw):
    spec = SPECS[op]
    s = make_state(spec, [(7,), (0,), (3, 5)], BF16, REMAINDER, "cpu",
                   stateless=kw.get("momentum") == 0.0)
    args, kwargs = op_args(spec, s, master_mode=REMAINDER, lr_tensor=torch.tensor(1e-3),
                           grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()),
                           norm_sq=torch.tensor(4.0), max_grad_norm=1.0, seed=3, **kw)
    torch.library.opcheck(OPS[spec.name].overload, args, kwargs)


@pytest.mark.parametrize("op,dtype,mode,kw", [
    ("sgd", F32, NONE, dict(momentum=0.0)), ("sgd", BF16, STOCHASTIC, dict(nesterov=True)),
    ("sgd", F16, FP32_MASTER, dict()), ("lion", F32, NONE, dict()),
    ("lion", BF16, REMAINDER, dict(weight_decay=0.1)), ("lion", BF16, STOCHASTIC, dict())])
def test_bound_op_equals_plain_call(dev, op, dtype, mode, kw):
    spec = SPECS[op]
    shapes = [(1,), (0,), (7,), (4097,), (5, 13)]
    s = make_state(spec, shapes, dtype, mode, dev, stateless=kw.get("momentum") == 0.0)
    for k in ("params", spec.state, "masters"):  # a transposed param, its state shares strides
        if s[k]:
            s[k][4] = s[k][4].t().contiguous().t()
    ids, offsets = [5, 9, 2, 40, 41], [0, 0, 100, 0, 1 << 40]
    h = dict(spec.hyper, **kw, master_mode=mode, grad_scale=torch.tensor(4.0, device=dev),
             found_inf=torch.zeros((), device=dev), norm_sq=torch.tensor(9.0, device=dev),
             max_grad_norm=1.0, seed=11)
    rest = {k: h[k] for k in spec.order if k not in ("param_ids", "elem_offsets")}
    plain, bound = clone_state(s), clone_state(s)
    call = BoundOp(_NoPlainCall(OPS[spec.name]), [bound[k] for k in spec.keys if k != "grads"],
                   ids, offsets)
    for _ in range(3):
        OPS[spec.name](*(plain[k] for k in spec.keys), **rest, param_ids=ids, elem_offsets=offsets,
                       backend="native")
        call(bound["grads"], **rest, backend="native")
    assert_bits_equal(spec, plain, bound)
    assert float(bound["steps"][0]) == float(s["steps"][0]) + 3
