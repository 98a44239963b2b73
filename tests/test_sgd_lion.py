"""mpfused.SGD and mpfused.Lion as optimizers, on every backend that serves their ops here:
torch.optim.SGD / bitsandbytes' Lion / the lion-pytorch formula step for step on fp32 params,
16-bit params with every master mode, the GradScaler protocol (a skipped step changes nothing),
fused clipping, LR schedulers, save / load / continue, sign(0) and NaN.
torch's own SGD configurations and error inputs: tests/test_torch_optim_db.py,
tests/test_torch_error_inputs.py. Kernel-level checks: tests/test_sgd_lion_kernels.py."""
from __future__ import annotations

import copy

import pytest
import torch

import mpfused
from tests.conftest import backends_for
from tests.tolerances import TRAJ_TOL

SHAPES = ((13, 7), (31,), (2, 3, 5), (0,), (4097,))


def _backends(op):
    return backends_for(op, "cpu")


def _params(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]


def _grads(params, gen, scale=1.0):
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


def _run(opt, params, steps, seed=1, scale=1.0, scaler=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, g in zip(params, _grads(params, gen, scale)):
            p.grad = g
        if scaler is None:
            opt.step()
        else:
            scaler.scale(torch.zeros(()))  # as a loss would: the scale exists from here on
            scaler.step(opt)
            scaler.update()


def _lion_torch(params, lr, betas, wd, steps, seed=1):
    """lion-pytorch's update in fp32 torch ops: p *= 1 - lr*wd; p -= lr*sign(b1*m + (1-b1)*g);
    m = b2*m + (1-b2)*g."""
    ms = [torch.zeros_like(p) for p in params]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(steps):
            for p, m, g in zip(params, ms, _grads(params, gen)):
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(m * betas[0] + g * (1 - betas[0])), alpha=-lr)
                m.mul_(betas[1]).add_(g, alpha=1 - betas[1])
    return ms


SGD_CONFIGS = [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.5),
               dict(momentum=0.9, nesterov=True, weight_decay=0.1),
               dict(weight_decay=0.1, maximize=True), dict(momentum=0.5, lr=torch.tensor(0.01))]


@pytest.mark.parametrize("backend", _backends("sgd_step_"))
@pytest.mark.parametrize("kwargs", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch(backend, kwargs):
    ref, ours = _params(), _params()
    kw = {"lr": 0.05, **kwargs}
    o_ref = torch.optim.SGD(ref, foreach=False, **copy.deepcopy(kw))
    o_ours = mpfused.SGD(ours, backend=backend, **copy.deepcopy(kw))
    _run(o_ref, ref, 8)
    _run(o_ours, ours, 8)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
        if kw.get("momentum"):
            torch.testing.assert_close(o_ours.state[b]["momentum_buffer"],
                                       o_ref.state[a]["momentum_buffer"], **TRAJ_TOL)
        else:
            assert "momentum_buffer" not in o_ours.state[b]  # as torch: no buffer without momentum


@pytest.mark.parametrize("backend", _backends("lion_step_"))
@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.1, False), (0.1, True)])
def test_lion_matches_lion_pytorch_formula(backend, wd, maximize):
    ref, ours = _params(), _params()
    if maximize:  # maximize is minimizing -loss: the formula on negated grads
        ref_ms = None
    lr, betas = 1e-2, (0.9, 0.99)
    opt = mpfused.Lion(ours, lr=lr, betas=betas, weight_decay=wd, maximize=maximize,
                       backend=backend)
    _run(opt, ours, 8)
    if maximize:
        gen = torch.Generator().manual_seed(1)
        ms = [torch.zeros_like(p) for p in ref]
        with torch.no_grad():
            for _ in range(8):
                for p, m, g in zip(ref, ms, _grads(ref, gen)):
                    g = -g
                    p.mul_(1 - lr * wd)
                    p.add_(torch.sign(m * betas[0] + g * (1 - betas[0])), alpha=-lr)
                    m.mul_(betas[1]).add_(g, alpha=1 - betas[1])
        ref_ms = ms
    else:
        ref_ms = _lion_torch(ref, lr, betas, wd, 8)
    for a, b, m in zip(ref, ours, ref_ms):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
        torch.testing.assert_close(opt.state[b]["exp_avg"], m, **TRAJ_TOL)


def test_lion_matches_bitsandbytes_lion():
    """bitsandbytes' 32-bit Lion (its CPU path) step for step. Measured: equal to fp32 rounding
    (max |diff| ~1e-7 on unit-scale params after 8 steps)."""
    bnb = pytest.importorskip("bitsandbytes")
    ref, ours = _params(), _params()
    ref = [p for p in ref if p.numel()]  # bitsandbytes steps no empty params
    ours = [p for p in ours if p.numel()]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    o_ref = bnb.optim.Lion(ref, optim_bits=32, **kw)
    o_ours = mpfused.Lion(ours, **kw)
    _run(o_ref, ref, 8)
    _run(o_ours, ours, 8)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
        torch.testing.assert_close(o_ours.state[b]["exp_avg"], o_ref.state[a]["state1"],
                                   **TRAJ_TOL)


def test_lion_sign_of_zero_and_nan():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = mpfused.Lion([p], lr=0.1)
    p.grad = torch.tensor([0.0, 0.0, 1.0])
    opt.step()  # m = 0 and g = 0: sign(0) = 0, the param does not move
    assert p.tolist()[:2] == [1.0, -2.0] and p[2].item() == pytest.approx(2.9)
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    opt.step()
    # a NaN gradient shows, never a silent zero step (torch.sign and bitsandbytes give 0 there)
    assert torch.isnan(p[0]) and torch.isnan(opt.state[p]["exp_avg"][0])


OPTIMIZERS = [(mpfused.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
              (mpfused.SGD, dict(lr=0.05)),
              (mpfused.Lion, dict(lr=1e-2, weight_decay=0.1))]
OPT_IDS = ["sgd-momentum", "sgd-plain", "lion"]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("dtype,mode", [(torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"),
                                        (torch.float16, "fp32"), (torch.bfloat16, "none"),
                                        (torch.float16, "none")])
def test_16bit_params_follow_the_fp32_run(cls, kw, dtype, mode):
    """With a master (fp32 or the exact int16 remainder) a 16-bit run is the fp32 run on the
    master values (same fp32 math; only the grads are 16-bit), the param its rounding; without
    one (bf16: stochastic rounding; fp16: round to nearest) the params stay within a few 16-bit
    ulps of it."""
    ref = _params(dtype)  # start from the same 16-bit values
    ref32 = [torch.nn.Parameter(p.detach().float()) for p in ref]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o32 = cls(ref32, **kw)
    opt = cls(ours, master_weights=mode, **kw)
    gen32, gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(6):
        grads = _grads(ours, gen)
        for p, q, g in zip(ref32, ours, grads):
            p.grad, q.grad = g.float(), g
        o32.step()
        opt.step()
    del gen32
    for a, b in zip(ref32, ours):
        st = opt.state[b]
        if mode == "fp32":
            torch.testing.assert_close(st["master"], a.detach(), rtol=0, atol=0)
            assert torch.equal(b, a.detach().to(dtype))
        elif mode == "remainder":
            assert "master" not in st and st["master_remainder"].dtype == torch.int16
            from mpfused.optim._masters import master_from_remainder
            torch.testing.assert_close(master_from_remainder(b, st["master_remainder"]),
                                       a.detach(), rtol=0, atol=0)
        else:
            torch.testing.assert_close(b.float(), a.detach(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("dtype,mode", [(torch.float16, "fp32"), (torch.bfloat16, "remainder"),
                                        (torch.bfloat16, "none")])
def test_scaler_skip_changes_nothing(cls, kw, dtype, mode):
    params = _params(dtype)
    opt = cls(params, master_weights=mode, **kw)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0 ** 10)
    _run(opt, params, 2, scale=2.0 ** 10, scaler=scaler)
    before = ([p.detach().clone() for p in params],
              copy.deepcopy({k: v for k, v in opt.state_dict()["state"].items()}))
    scale = scaler.get_scale()
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    params[1].grad[3] = float("inf")
    scaler.scale(torch.zeros(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2  # backed off
    for a, b in zip(before[0], params):
        assert torch.equal(a, b)
    after = opt.state_dict()["state"]
    for pid, st in before[1].items():
        for key, value in st.items():
            assert torch.equal(after[pid][key], value), (pid, key)  # step counters included


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
def test_scaled_steps_equal_unscaled(cls, kw):
    """In-kernel unscale: grads scaled by 2^k step exactly as unscaled ones (a power of two)."""
    a, b = _params(), _params()
    oa, ob = cls(a, **kw), cls(b, **kw)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    _run(oa, a, 4)
    _run(ob, b, 4, scale=2.0 ** 8, scaler=scaler)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
def test_fused_clipping_equals_clip_then_step(cls, kw):
    ref, ours = _params(), _params()
    o_ref, o_ours = cls(ref, **kw), cls(ours, max_grad_norm=1.0, **kw)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        for p, q, g in zip(ref, ours, _grads(ref, gen, scale=3.0)):
            p.grad, q.grad = g, g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        o_ref.step()
        o_ours.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
def test_save_load_continue_equals_uninterrupted(cls, kw):
    full, part = _params(torch.bfloat16), _params(torch.bfloat16)
    of = cls(full, master_weights="none", **kw)  # stochastic rounding: the step seeds resume too
    _run(of, full, 6)
    op = cls(part, master_weights="none", **kw)
    _run(op, part, 3)
    sd = copy.deepcopy(op.state_dict())
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in part]
    op2 = cls(fresh, master_weights="none", **kw)
    op2.load_state_dict(sd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # the uninterrupted run's first 3 grads, then the next 3
        _grads(fresh, gen)
    for _ in range(3):
        for p, g in zip(fresh, _grads(fresh, gen)):
            p.grad = g
        op2.step()
    for a, b in zip(full, fresh):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", _backends("sgd_step_"))
def test_sgd_with_lr_scheduler_as_torch(backend):
    ref, ours = _params(), _params()
    o_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False)
    o_ours = mpfused.SGD(ours, lr=0.1, momentum=0.9, backend=backend)
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=2, gamma=0.5)
    s_ours = torch.optim.lr_scheduler.StepLR(o_ours, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        for p, q, g in zip(ref, ours, _grads(ref, gen)):
            p.grad, q.grad = g, g.clone()
        o_ref.step()
        o_ours.step()
        s_ref.step()
        s_ours.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


def test_sgd_first_step_with_dampening_is_torchs():
    """torch clones the first gradient into the buffer (no dampening on step 1); a skipped first
    step leaves the next one the first."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = mpfused.SGD([p], lr=1.0, momentum=0.9, dampening=0.5)
    scaler = mpfused.GradScaler("cpu", init_scale=1.0)
    p.grad = torch.tensor([float("inf"), 0.0, 0.0])
    scaler.scale(torch.zeros(()))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0]) * scaler.get_scale()
    scaler.step(opt)
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(p.detach(), torch.tensor([0.0, -1.0, -2.0]))


def test_torch_sgd_state_dict_loads_and_continues():
    ref, ours = _params(), _params()
    o_ref = torch.optim.SGD(ref, lr=0.05, momentum=0.9, dampening=0.3, foreach=False)
    _run(o_ref, ref, 3)
    for a, b in zip(ref, ours):
        b.data.copy_(a.data)
    o_ours = mpfused.SGD(ours, lr=0.05, momentum=0.9, dampening=0.3)
    o_ours.load_state_dict(o_ref.state_dict())
    _run(o_ref, ref, 3, seed=7)
    _run(o_ours, ours, 3, seed=7)  # buffers present: no first-step clone
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


def test_constructor_checks():
    p = [torch.nn.Parameter(torch.randn(2))]
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        mpfused.SGD(p, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        mpfused.Lion(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        mpfused.Lion(p, lr=-1.0)
    with pytest.raises(ValueError, match="master_weights must be one of"):
        mpfused.SGD(p, master_weights="fp64")
    with pytest.raises(ValueError, match="needs bfloat16 params"):
        q = [torch.nn.Parameter(torch.randn(2).half())]
        q[0].grad = torch.randn(2).half()
        mpfused.Lion(q, master_weights="remainder").step()
