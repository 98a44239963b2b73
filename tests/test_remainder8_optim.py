"""master_weights="remainder8" on every optimizer of the engine (AdamW, Adam, AdamW8bit, SGD,
Lion, SGD8bit, Lion8bit): the trajectory against the same optimizer with fp32 masters (on the
native, Triton and float64 reference backends), skipped steps, save / load / continue, the
conversions between master forms, the errors, release and estimate_memory. The codec itself:
tests/test_remainder8.py."""
import copy

import pytest
import torch

import mpfused
from mpfused.ops import OPS
from mpfused.reference.adam import remainder8_join, remainder8_split

BF16 = torch.bfloat16
SHAPES = ((37, 11), (300,), (2, 3, 5), (1,), (1200,))  # odd sizes; 1200 >= min_8bit_size
OPTIMIZERS = {
    "AdamW": (mpfused.AdamW, {"weight_decay": 0.1}),
    "Adam-amsgrad": (mpfused.Adam, {"amsgrad": True, "weight_decay": 0.01}),
    "AdamW8bit": (mpfused.AdamW8bit, {"min_8bit_size": 1000, "block_size": 64}),
    "SGD": (mpfused.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "Lion": (mpfused.Lion, {"weight_decay": 0.1}),
    "SGD8bit": (mpfused.SGD8bit, {"momentum": 0.9, "min_8bit_size": 1000, "block_size": 64}),
    "Lion8bit": (mpfused.Lion8bit, {"min_8bit_size": 1000, "block_size": 64}),
}
_8BIT_OP = {mpfused.AdamW8bit: "adam8bit_step_", mpfused.SGD8bit: "sgd8bit_step_",
            mpfused.Lion8bit: "lion8bit_step_"}
STEPS, LR = 8, 1e-2


def _backend_or_skip(cls, backend):
    op = _8BIT_OP.get(cls, {mpfused.SGD: "sgd_step_", mpfused.Lion: "lion_step_"}.get(
        cls, "adam_step_"))
    if backend not in OPS[op].available("cpu"):
        pytest.skip(f"{op} has no {backend} CPU backend here")


def _params(seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in SHAPES]


def _grads(g, params):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _run(name, master_weights, backend, steps=STEPS, seed=0, inf_step=None):
    cls, kw = OPTIMIZERS[name]
    params = _params(seed)
    opt = cls(params, lr=LR, master_weights=master_weights, backend=backend, **kw)
    scaler = mpfused.GradScaler("cpu", init_scale=1.0, growth_interval=1000, backend="native")
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        _grads(g, params)
        if step == inf_step:
            params[0].grad[0, 0] = float("inf")
        scaler.scale(torch.ones(()))  # the scale's lazy init, as a scaled loss would do
        scaler.step(opt)
        scaler.update()
    return params, opt


def _value(p, state):
    """The fp32 value the optimizer keeps for p."""
    if "master_remainder8" in state:
        return remainder8_join(p.detach(), state["master_remainder8"])
    return state["master"] if "master" in state else p.detach().float()


@pytest.mark.parametrize("backend", ["native", "reference", "triton"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trajectory_within_the_24_bit_bound_of_fp32_masters(name, backend):
    """After STEPS steps the 24-bit master differs from the fp32-master run of the same optimizer
    and backend by at most (STEPS + 1) * 2^-16 of the largest |w| per element: each store rounds
    by <= 2^-16 |w| and none of these updates reads w except through weight decay (which
    shrinks an error), so the errors only add up. A bf16-only master would be off by 2^-9 |w|
    per step (30x more); the 8-bit optimizers have 8-bit state (the check shows it is used)."""
    cls, _ = OPTIMIZERS[name]
    if backend == "triton" and name not in ("AdamW8bit", "Lion"):
        pytest.skip("the Triton interpreter is slow: two cases (the others: backend agreement)")
    _backend_or_skip(cls, backend)
    p8, o8 = _run(name, "remainder8", backend)
    p32, o32 = _run(name, "fp32", backend)
    for a, b in zip(p8, p32):
        st = o8.state[a]
        assert st["master_remainder8"].dtype == torch.int8 and "master" not in st
        w8, w32 = _value(a, st).double(), o32.state[b]["master"].double()
        bound = (STEPS + 1) * 2.0**-16 * float(w32.abs().max())
        assert float((w8 - w32).abs().max()) <= bound, (name, backend, a.shape)
        assert torch.all(remainder8_join(*remainder8_split(w8.float())) == w8.float())
        # the param is the master rounded to bf16
        assert float((a.detach().double() - w8).abs().max()) <= 2.0**-8 * float(w8.abs().max())
    if cls in _8BIT_OP:
        assert any(v.dtype == torch.uint8 for s in o8.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "SGD8bit", "Lion"])
def test_backends_agree_bit_for_bit(name):
    """native = Triton (interpreter) bit for bit on remainder8 (params, corrections, state)."""
    cls, _ = OPTIMIZERS[name]
    _backend_or_skip(cls, "native")
    _backend_or_skip(cls, "triton")
    (pn, on), (pt, ot) = _run(name, "remainder8", "native", 3), _run(name, "remainder8", "triton", 3)
    for a, b in zip(pn, pt):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for key, value in on.state[a].items():
            assert torch.equal(value, ot.state[b][key]), key


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "SGD", "Lion8bit"])
def test_skipped_step_changes_nothing(name):
    """A step with an inf grad (GradScaler's found_inf) leaves params, corrections, state and
    step counters bit for bit as they were: the run with it equals the run one step shorter
    whose skipped step is left out (same grads otherwise)."""
    cls, _ = OPTIMIZERS[name]
    backend = "native" if "native" in OPS["adam_step_"].available("cpu") else "reference"
    _backend_or_skip(cls, backend)
    params, opt = _run(name, "remainder8", backend, steps=2)
    before = [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values()]
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[5] = float("nan")
    scaler = mpfused.GradScaler("cpu", init_scale=1.0, backend="native")
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    after = [p.detach() for p in params] + [v for p in params for v in opt.state[p].values()]
    assert len(before) == len(after)
    for x, y in zip(before, after):
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "SGD8bit", "Lion"])
def test_save_load_continue_equals_uninterrupted(name):
    """state_dict holds "master_remainder8" (int8, the param's shape); a new optimizer that loads
    it (through torch.save / torch.load) continues exactly as the uninterrupted run."""
    cls, kw = OPTIMIZERS[name]
    backend = "native" if "native" in OPS["adam_step_"].available("cpu") else "reference"
    _backend_or_skip(cls, backend)
    full, _ = _run(name, "remainder8", backend, steps=6)
    params, opt = _run(name, "remainder8", backend, steps=3)
    sd = opt.state_dict()
    for s in sd["state"].values():
        assert s["master_remainder8"].dtype == torch.int8
    import io
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "opt": sd}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = [torch.nn.Parameter(t) for t in saved["model"]]
    opt2 = cls(resumed, lr=LR, master_weights="remainder8", backend=backend, **kw)
    opt2.load_state_dict(saved["opt"])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the grads of steps 0-2, drawn and dropped
        for p in resumed:
            torch.randn(p.shape, generator=g)
    scaler = mpfused.GradScaler("cpu", init_scale=1.0, growth_interval=1000, backend="native")
    for _ in range(3):
        _grads(g, resumed)
        scaler.scale(torch.ones(()))
        scaler.step(opt2)
        scaler.update()
    for a, b in zip(full, resumed):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_conversions_between_master_forms():
    """fp32 master -> remainder8: the master rounded to 24 bits (the param re-rounded from it);
    remainder8 -> fp32 / remainder (int16): exact, the 24-bit value; remainder8 -> remainder ->
    remainder8: unchanged. refresh_master_weights zeroes the correction (the bf16 value)."""
    params = _params(3)
    opt = mpfused.AdamW(params, lr=LR, backend="reference")
    g = torch.Generator().manual_seed(4)
    _grads(g, params)
    opt.step()
    masters = [opt.state[p]["master"].clone() for p in params]
    for group in opt.param_groups:
        group["master_weights"] = "remainder8"
    opt._plan(0, opt.param_groups[0], [p.grad for p in params], cache=False)
    r8 = []
    for p, m in zip(params, masters):
        st = opt.state[p]
        assert "master" not in st and st["master_remainder8"].dtype == torch.int8
        want_p, want_r = remainder8_split(m)
        assert torch.equal(st["master_remainder8"], want_r)
        assert torch.equal(p.detach().view(torch.int16), want_p.view(torch.int16))
        r8.append(remainder8_join(p.detach(), st["master_remainder8"]))
    for mode in ("remainder", "fp32", "remainder8"):
        for group in opt.param_groups:
            group["master_weights"] = mode
        opt._plan(0, opt.param_groups[0], [p.grad for p in params], cache=False)
        for p, w in zip(params, r8):
            assert torch.equal(_value_any(p, opt.state[p]), w), mode
    opt.refresh_master_weights()
    for p in params:
        assert torch.all(opt.state[p]["master_remainder8"] == 0)


def _value_any(p, st):
    from mpfused.optim._masters import master_value
    return master_value(p, st)


def test_errors_name_the_rule():
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    half.grad = torch.ones_like(half)
    with pytest.raises(ValueError, match="remainder8.*bfloat16"):
        mpfused.AdamW([half], master_weights="remainder8").step()
    with pytest.raises(ValueError, match="master_weights must be one of"):
        mpfused.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, master_weights="remainder4")
    p, grad = torch.ones(4, dtype=BF16), torch.ones(4, dtype=BF16)
    args = ([grad], [], None, [torch.zeros(())], 0.1, None, 0.0, 0.0, 0.0, False, False)
    for backend in OPS["sgd_step_"].available("cpu"):
        if backend == "reference":
            continue
        with pytest.raises(RuntimeError, match=r"masters.*\[0\] must be .*(Char|int8)"):
            OPS["sgd_step_"]([p], [grad], [], [torch.zeros(4, dtype=torch.int16)],
                             [torch.zeros(())], lr=0.1, lr_tensor=None, momentum=0.0, dampening=0.0,
                             weight_decay=0.0, nesterov=False, maximize=False, master_mode=4,
                             backend=backend)
        with pytest.raises(RuntimeError, match=r"params\[0\] is float16"):
            OPS["sgd_step_"]([p.half()], [grad.half()], [], [torch.zeros(4, dtype=torch.int8)],
                             [torch.zeros(())], lr=0.1, lr_tensor=None, momentum=0.0, dampening=0.0,
                             weight_decay=0.0, nesterov=False, maximize=False, master_mode=4,
                             backend=backend)
        with pytest.raises(RuntimeError, match="master_mode must be"):
            OPS["sgd_step_"]([p], [grad], [], [], [torch.zeros(())], lr=0.1, lr_tensor=None,
                             momentum=0.0, dampening=0.0, weight_decay=0.0,
                             nesterov=False, maximize=False, master_mode=5, backend=backend)
    del args


def test_estimate_memory_bytes_per_param():
    """bf16 + int8 correction + 8-bit AdamW states: 2 + 2 + 1 + 2.03 = 7.03 B/param, 5.03 with
    release (grads freed in the backward); with fp32 moments 13."""
    from mpfused.amp import estimate_memory
    n = 7_000_000_000
    e = estimate_memory(n, "8bit-remainder8")
    assert e.master == n and abs(e.bytes_per_param - 7.03125) < 1e-3
    r = estimate_memory(n, "8bit-remainder8-release")
    assert r.grads == 0 and abs(r.bytes_per_param - 5.03125) < 1e-3
    assert estimate_memory(n, "remainder8").bytes_per_param == 13
    model = torch.nn.Linear(4096, 64)
    assert estimate_memory(model, "8bit-remainder8").master == 4096 * 64 + 64


def test_checkpoints_load_across_master_modes():
    """An fp32-master checkpoint loads into remainder8 (the master rounded to 24 bits, the param
    re-rounded from it); a remainder8 checkpoint loads into an fp32-master optimizer (the master
    is the joined 24-bit value, exact) and into a remainder (int16) one (the same value). The
    loaded groups carry the checkpoint's master_weights (torch restores group options): the
    mode is set after the load, and the next step (here its plan) converts."""
    def switch(o, mode, ps):
        for group in o.param_groups:
            group["master_weights"] = mode
        for p in ps:
            p.grad = torch.zeros_like(p)
        o._plan(0, o.param_groups[0], [p.grad for p in ps], cache=False)

    params = _params(5)
    opt = mpfused.AdamW(params, lr=LR, backend="reference")
    g = torch.Generator().manual_seed(6)
    _grads(g, params)
    opt.step()
    masters = [opt.state[p]["master"].clone() for p in params]
    p8 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt8 = mpfused.AdamW(p8, lr=LR, master_weights="remainder8", backend="reference")
    opt8.load_state_dict(copy.deepcopy(opt.state_dict()))
    switch(opt8, "remainder8", p8)
    for p, m in zip(p8, masters):
        want_p, want_r = remainder8_split(m)
        assert torch.equal(opt8.state[p]["master_remainder8"], want_r) and "master" not in opt8.state[p]
        assert torch.equal(p.detach().view(torch.int16), want_p.view(torch.int16))
    for mode in ("fp32", "remainder"):
        q = [torch.nn.Parameter(p.detach().clone()) for p in p8]
        other = mpfused.AdamW(q, lr=LR, master_weights=mode, backend="reference")
        other.load_state_dict(copy.deepcopy(opt8.state_dict()))
        switch(other, mode, q)
        for a, b in zip(p8, q):
            assert torch.equal(_value_any(b, other.state[b]),
                               remainder8_join(a.detach(), opt8.state[a]["master_remainder8"]))
