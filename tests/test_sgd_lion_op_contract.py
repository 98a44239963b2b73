"""sgd_step_ and lion_step_'s contract on every backend, on the harness of
tests/test_sgd_lion_kernels.py: SGD's first step, torch.optim.SGD, Lion's sign at 0 and NaN, skip on
found_inf bit for bit, NaN propagation, stochastic rounding bit-exact given the same fp32 value,
no host sync, bad arguments rejected before any change, opcheck, BoundOp = plain call."""
import pytest
import torch

from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from mpfused.reference import adam as ref
from tests.test_adam_master_modes import _sr_expected
from tests.test_bound_ops import _NoPlainCall
from tests.test_sgd_lion_kernels import (BF16, DEV_BACKENDS, F16, F32, FP32_MASTER, HYPER, KEYS,
                                         NONE, OPS_UNDER_TEST, REMAINDER, STOCHASTIC, TAIL,
                                         assert_state_close, bits_equal, clone_state, every_backend,
                                         make_state, new_grads, op_args, step)
from tests.tolerances import assert_close

NATIVE = [p for p in DEV_BACKENDS if p.values[1] == "native"]


def assert_bits_equal(a, b):
    assert all(bits_equal(x, y) for k in KEYS for x, y in zip(a[k], b[k]))


# ---- SGD's first step, torch.optim.SGD, Lion's sign -------------------------------------------
@every_backend
@pytest.mark.parametrize("dampening,weight_decay", [(0.0, 0.0), (0.5, 0.0), (0.5, 0.1)])
def test_sgd_first_step_buffer_is_the_gradient(dev, backend, dampening, weight_decay):
    # t == 1: buf = g itself (torch clones it), dampening not applied and the old buffer (here NaN
    # garbage) never read; later tensors in the same call at t > 1 use theirs.
    s = make_state([(5, 7), (300,), (4,)], F32, NONE, dev, steps=[0, 0, 6])
    for b in s["state"][:2]:
        b.fill_(float("nan"))
    old = s["state"][2].clone()
    p0 = [p.clone() for p in s["params"]]
    step("sgd_step_", s, backend, dampening=dampening, weight_decay=weight_decay, lr=0.1)
    g = [gi + weight_decay * pi if weight_decay else gi for gi, pi in zip(s["grads"], p0)]
    for i in range(2):
        if weight_decay:
            assert_close(s["state"][i], g[i], dtype=F32)
        else:  # torch clones the gradient: bit for bit
            assert torch.equal(s["state"][i], g[i])
    assert_close(s["state"][2], 0.9 * old + (1 - dampening) * g[2], dtype=F32)
    assert all(torch.isfinite(p).all() for p in s["params"])


@every_backend
def test_sgd_first_step_takes_the_gradient(dev, backend):
    # step counter 0: the buffer becomes the (unscaled, decayed) grad, whatever it held before;
    # counters of 1 and more: momentum * buf + (1 - dampening) * g
    s = make_state([(33,), (33,), (0,)], F32, NONE, dev, steps=[0, 4, 0])
    s["state"][0].fill_(float("nan"))  # never read on a first step
    g = [x.clone() for x in s["grads"]]
    w, b = s["params"][1].clone(), s["state"][1].clone()
    step("sgd_step_", s, backend, momentum=0.9, dampening=0.25, weight_decay=0.0,
         grad_scale=torch.tensor(4.0, device=dev))
    assert torch.equal(s["state"][0], g[0] / 4)
    assert_close(s["state"][1], 0.9 * b + 0.75 * g[1] / 4)
    assert_close(s["params"][1], w - 1e-2 * s["state"][1])
    assert [t.item() for t in s["steps"]] == [1.0, 5.0, 1.0]


# OP_TOL fp32 after 4 steps (measured: |diff| - 1e-6 |p| <= 3e-8, atol 1e-6): torch's
# add_(alpha=) fuses multiply and add (one rounding) where the kernels never contract (the
# bit-exact CPU = CUDA contract), an ulp apart per step.
TORCH_SGD_TOL = dict(dtype=F32)
TORCH_SGD = [(0.0, 0.0, False, 0.0, False), (0.9, 0.0, False, 0.01, False),
             (0.9, 0.3, False, 0.0, True), (0.9, 0.0, True, 0.01, False),
             (0.5, 0.0, True, 0.1, True)]


@pytest.mark.parametrize("dev,backend", [p for p in DEV_BACKENDS if p.values[0] == "cpu"])
@pytest.mark.parametrize("momentum,dampening,nesterov,wd,maximize", TORCH_SGD)
def test_sgd_matches_torch_optim(dev, backend, momentum, dampening, nesterov, wd, maximize):
    # fp32 params over 4 steps against torch.optim.SGD's for-loop, both fp32 in torch's order.
    hyper = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                 weight_decay=wd, maximize=maximize)
    shapes = [(7,), (33, 5), (0,), (1000,)]
    # step 0: the buffers' random values are never read (t == 1 starts them from the gradient)
    s = make_state(shapes, F32, NONE, dev, steps=[0] * 4)
    tp = [p.clone().requires_grad_() for p in s["params"]]
    opt = torch.optim.SGD(tp, foreach=False, **hyper)
    for _ in range(4):
        new_grads(s, 1.0)
        for p, g in zip(tp, s["grads"]):
            p.grad = g.clone()
        opt.step()
        step("sgd_step_", s, backend, **hyper)
    for i, p in enumerate(tp):
        assert_close(s["params"][i], p.detach(), **TORCH_SGD_TOL)
        if momentum:
            assert_close(s["state"][i], opt.state[p]["momentum_buffer"], **TORCH_SGD_TOL)


@every_backend
def test_lion_sign_zero_and_nan(dev, backend):
    # c = beta1 * m + (1 - beta1) * g: exactly 0 (m = g = 0) moves nothing (only the decay), and a
    # NaN gradient makes a NaN param and moment, as torch.sign, never a silent zero step.
    p = torch.tensor([1.5, -2.0, 0.25, 3.0], device=dev)
    g = torch.tensor([0.0, 0.0, float("nan"), 1.0], device=dev)
    m = torch.tensor([0.0, -0.0, 0.5, 0.0], device=dev)
    out = {}
    for be in (backend, "reference"):
        s = {"params": [p.clone()], "grads": [g.clone()], "state": [m.clone()], "masters": [],
             "steps": [torch.zeros((), device=dev)]}
        step("lion_step_", s, be, weight_decay=0.5)
        out[be] = s
    t, r = out[backend], out["reference"]
    decay = torch.tensor(1 - 1e-2 * 0.5, dtype=torch.float64).float().to(dev)
    assert torch.equal(t["params"][0][:2], p[:2] * decay)
    assert torch.isnan(t["params"][0][2]) and torch.isnan(t["state"][0][2])
    assert torch.isnan(r["params"][0][2]) and torch.isnan(r["state"][0][2])
    assert_close(t["params"][0][[0, 1, 3]], r["params"][0][[0, 1, 3]])


# ---- skip, NaN, stochastic rounding -------------------------------------------------------------
@every_backend
@pytest.mark.parametrize("op", OPS_UNDER_TEST)
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC],
                         ids=["master", "remainder", "stochastic"])
def test_skip_on_found_inf(dev, backend, op, mode):
    s = make_state([(7,), (0,), (33,), (4, 5)], [F32, BF16, BF16, BF16], mode, dev,
                   steps=[0, 0, 3, 1])
    s["grads"][2][3] = float("inf")
    before = clone_state(s)
    found = torch.ones(1, device=dev)  # a [1] tensor, as torch's GradScaler keeps it
    step(op, s, backend, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=found, norm_sq=torch.tensor(float("inf"), device=dev), max_grad_norm=1.0,
         lr_tensor=torch.tensor(1e-2, device=dev), weight_decay=0.1)
    assert_bits_equal(s, before)
    # found_inf == 0: the step is taken and every counter advances (empty tensors' included)
    new_grads(s, 8.0)
    step(op, s, backend, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=torch.zeros(1, device=dev))
    assert [x.item() for x in s["steps"]] == [y.item() + 1 for y in before["steps"]]
    assert not torch.equal(s["state"][0], before["state"][0])


@every_backend
@pytest.mark.parametrize("dtype,mode", [(F32, NONE), (F16, NONE), (F16, FP32_MASTER),
                                        (BF16, FP32_MASTER), (BF16, REMAINDER), (BF16, STOCHASTIC)])
@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_nan_propagates(dev, backend, op, dtype, mode):
    # A NaN gradient element shows as NaN in its param (and master) and state, never as a silent
    # finite value; the other elements stay finite.
    s = make_state([(40,)], dtype, mode, dev, steps=[3])
    s["grads"][0][5] = float("nan")
    step(op, s, backend, master_mode=mode, weight_decay=0.1)
    p = s["params"][0].float()
    assert torch.isnan(p[5]) and torch.isnan(s["state"][0][5])
    if mode == FP32_MASTER:
        assert torch.isnan(s["masters"][0][5])
    if mode == REMAINDER:
        assert torch.isnan(ref.remainder_join(s["params"][0], s["masters"][0])[5])
    others = torch.arange(40, device=dev) != 5
    assert torch.isfinite(p[others]).all() and torch.isfinite(s["state"][0][others]).all()


@every_backend
@pytest.mark.parametrize("keys", ["positions", "ids"])
@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_stochastic_bit_exact(dev, backend, op, keys):
    # Given the same fp32 value w (the kernel's own fp32-master run from identical inputs), the
    # bf16 param is exactly reference.bf16_stochastic(w, random16(step_seed(seed, t),
    # sr_stream(param_id, elem_offset), logical index)).
    seed = 0x5DEECE66D
    shapes = [(0,), (4097,), (1,), (6, 7), (7,)]
    s = make_state(shapes, BF16, STOCHASTIC, dev, steps=[3, 0, 5, 2, 8])
    s["params"][3] = s["params"][3].t().contiguous().t()  # staged: SR follows the logical order
    m = clone_state(s)
    m["masters"] = [p.float() for p in s["params"]]
    ids = [10 * i + 3 for i in range(len(shapes))] if keys == "ids" else []
    offsets = [17 * i for i in range(len(shapes))] if keys == "ids" else []
    kw = dict(seed=seed, param_ids=ids, elem_offsets=offsets, weight_decay=0.1)
    step(op, s, backend, master_mode=STOCHASTIC, **kw)
    step(op, m, backend, master_mode=FP32_MASTER, **kw)
    for i, p in enumerate(s["params"]):
        assert torch.equal(s["state"][i], m["state"][i])  # the same fp32 path
        if p.numel():
            stream = ref.sr_stream(ids[i], offsets[i]) if ids else ref.sr_stream(i)
            expect = _sr_expected(m["masters"][i], seed, s["steps"][i].item(), stream)
            assert torch.equal(p.view(torch.int16), expect.view(torch.int16)), f"tensor {i}"


@every_backend
@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_no_host_sync(dev, backend, op, monkeypatch):
    # Every scalar is read on device: no .item()/bool()/float() on a tensor.
    s = make_state([(7,), (0,), (5, 3)], BF16, STOCHASTIC, dev, steps=[0, 2, 5])
    kw = dict(master_mode=STOCHASTIC, lr_tensor=torch.tensor(1e-2, device=dev),
              grad_scale=torch.tensor(4.0, device=dev), found_inf=torch.zeros((), device=dev),
              norm_sq=torch.tensor(2.0, device=dev), max_grad_norm=1.0)
    expect = clone_state(s)
    step(op, expect, "reference", **kw)

    def boom(*a, **k):
        raise AssertionError(f"host sync in the {backend} path")

    if dev == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    else:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, boom)
    try:
        step(op, s, backend, **kw)
    finally:
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    assert_state_close(s, expect, STOCHASTIC)


# ---- arguments, dispatcher, BoundOp -------------------------------------------------------------
# (op, list, index (None: the whole list), its replacement, message: where the native and Triton
# wordings differ, both, as alternatives)
BAD = [
    ("sgd_step_", "state", None, lambda x: [], "one momentum buffer per param"),
    ("sgd_step_", "state", 1, lambda x: x.double(), r"momentum_buffers\[1\] must be"),
    ("lion_step_", "state", 0, lambda x: x.half(), r"exp_avgs\[0\] must be"),
    ("lion_step_", "state", None, lambda x: x[:1],
     r"same length|exp_avgs has 1 tensors, expected 2"),
    ("sgd_step_", "grads", 0, lambda x: x.float(), r"grads\[0\] must have"),
    ("lion_step_", "steps", 1, lambda x: x.double(), r"steps\[1\] must be a 1-element"),
    ("sgd_step_", "masters", None, lambda x: [],
     "needs one master per param|one master per param is required"),
    ("lion_step_", "masters", 0, lambda x: x.half(), r"masters\[0\] must be"),
]


@every_backend
@pytest.mark.parametrize("op,key,index,bad,msg", BAD, ids=[f"{b[0][:-6]}-{b[1]}-{b[2]}" for b in BAD])
def test_bad_arguments_rejected_before_any_change(dev, backend, op, key, index, bad, msg):
    s = make_state([(7,), (3, 4)], BF16, FP32_MASTER, dev)
    if index is None:
        s[key] = bad(s[key])
    else:
        s[key][index] = bad(s[key][index])
    before = clone_state(s)
    with pytest.raises(RuntimeError, match=msg):
        step(op, s, backend, master_mode=FP32_MASTER)
    assert_bits_equal(s, before)


@every_backend
def test_argument_checks(dev, backend):
    s = make_state([(4,)], F32, NONE, dev)
    args, kwargs = op_args("sgd_step_", s)
    args = list(args)
    args[2] = []  # momentum 0.9 without buffers
    with pytest.raises(RuntimeError, match="momentum != 0 needs one momentum buffer per param"):
        OPS["sgd_step_"](*args, **kwargs, backend=backend)
    step("sgd_step_", {**s, "state": []}, backend, momentum=0.0)  # no buffers needed
    with pytest.raises(RuntimeError, match=r"exp_avgs has 0 tensors, expected 1|same length"):
        step("lion_step_", {**s, "state": []}, backend)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must have its param's dtype"):
        step("lion_step_", {**s, "grads": [s["grads"][0].half()]}, backend)
    with pytest.raises(RuntimeError,
                       match=r"momentum_buffers\[0\] must be (torch.float32|Float, got Double)"):
        step("sgd_step_", {**s, "state": [s["state"][0].double()]}, backend)


@pytest.mark.parametrize("op,kw", [("sgd_step_", dict(momentum=0.0)),
                                   ("sgd_step_", dict(nesterov=True)), ("lion_step_", dict())],
                         ids=["sgd-plain", "sgd-nesterov", "lion"])
def test_opcheck(op, kw):
    s = make_state([(7,), (0,), (3, 5)], BF16, REMAINDER, "cpu")
    args, kwargs = op_args(op, s, master_mode=REMAINDER, lr_tensor=torch.tensor(1e-3),
                           grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()),
                           norm_sq=torch.tensor(4.0), max_grad_norm=1.0, seed=3, **kw)
    torch.library.opcheck(OPS[op].overload, args, kwargs)


@pytest.mark.parametrize("dev,backend", NATIVE)
@pytest.mark.parametrize("op,dtype,mode,kw", [
    ("sgd_step_", F32, NONE, dict(momentum=0.0)),
    ("sgd_step_", BF16, STOCHASTIC, dict(nesterov=True)), ("sgd_step_", F16, FP32_MASTER, dict()),
    ("lion_step_", F32, NONE, dict()), ("lion_step_", BF16, REMAINDER, dict(weight_decay=0.1)),
    ("lion_step_", BF16, STOCHASTIC, dict())])
def test_bound_op_equals_plain_call(dev, backend, op, dtype, mode, kw):
    shapes = [(1,), (0,), (7,), (4097,), (5, 13)]
    s = make_state(shapes, dtype, mode, dev)
    for k in ("params", "state", "masters"):  # a transposed param, its state shares strides
        if s[k]:
            s[k][4] = s[k][4].t().contiguous().t()
    ids, offsets = [5, 9, 2, 40, 41], [0, 0, 100, 0, 1 << 40]
    h = {**HYPER[op], **TAIL, **kw, **dict(
        master_mode=mode, grad_scale=torch.tensor(4.0, device=dev),
        found_inf=torch.zeros((), device=dev), norm_sq=torch.tensor(9.0, device=dev),
        max_grad_norm=1.0, seed=11)}
    rest = {k: h[k] for k in (*HYPER[op], *TAIL) if k not in ("param_ids", "elem_offsets")}
    plain, bound = clone_state(s), clone_state(s)
    uses_state = op == "lion_step_" or h["momentum"] != 0
    if not uses_state:
        plain["state"], bound["state"] = [], []
    call = BoundOp(_NoPlainCall(OPS[op]), [bound[k] for k in KEYS if k != "grads"], ids, offsets)
    for _ in range(3):
        OPS[op](*(plain[k] for k in KEYS), **rest, param_ids=ids, elem_offsets=offsets,
                backend=backend)
        call(bound["grads"], **rest, backend=backend)
    assert_bits_equal(plain, bound)
    assert float(bound["steps"][0]) == float(s["steps"][0]) + 3
