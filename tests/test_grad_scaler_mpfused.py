"""mpfused.GradScaler beyond torch's: bf16 and mixed grads in one call, hysteresis and min/max
scale, extra validation, found_inf semantics, CUDA (no host sync, graph capture), step pre-hooks
(moved from tests/test_grad_scaler.py)."""
import warnings

import pytest
import torch

import mpfused
from torch.amp.grad_scaler import OptState
from tests.test_grad_scaler import IDS, SCALERS


def test_bf16_and_mixed_grads_in_one_call():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = mpfused.GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    for p in m.parameters():
        p.grad = torch.full_like(p, 8.0)
    s.unscale_(opt)
    for p in m.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 2.0))


def test_hysteresis_min_max():
    s = mpfused.GradScaler("cpu", init_scale=16.0, growth_interval=2, hysteresis=2, min_scale=4.0,
                           max_scale=32.0)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mpfused.AdamW([p])
    traj = []
    for bad in [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]:
        s.scale(torch.ones(()))
        p.grad = torch.tensor([float("inf") if bad else 1.0, 0.0])
        s.step(opt)
        s.update()
        traj.append(s.get_scale())
    # first overflow absorbed by hysteresis, then backs off to the floor, grows to the ceiling
    assert traj == [16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    sd = s.state_dict()
    assert sd["hysteresis"] == 2 and sd["min_scale"] == 4.0 and sd["max_scale"] == 32.0
    t = mpfused.GradScaler("cpu")
    t.load_state_dict(sd)
    assert t.get_hysteresis() == 2 and t.get_scale() == 32.0
    # torch loads our checkpoint too (it reads the 5 keys it knows)
    torch.amp.GradScaler("cpu").load_state_dict(sd)


def test_extra_validation():
    with pytest.raises(ValueError, match="hysteresis"):
        mpfused.GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="min_scale"):
        mpfused.GradScaler("cpu", min_scale=-1.0)
    with pytest.raises(ValueError, match="min_scale .* must be <= max_scale"):
        mpfused.GradScaler("cpu", min_scale=4.0, max_scale=2.0)


def test_found_inf_is_max_not_sum():
    """Two optimizers overflowing in the same iteration: the scale backs off once (H1)."""
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    opts = [mpfused.AdamW([p]) for p in ps]
    s = mpfused.GradScaler("cpu", init_scale=8.0)
    s.scale(torch.ones(()))
    for p, o in zip(ps, opts):
        p.grad = torch.full((3,), float("inf"))
        s.step(o)
    s.update()
    assert s.get_scale() == 4.0
    assert all(o.state[p]["step"].item() == 0 for p, o in zip(ps, opts))


def test_cuda_default_device_disables_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        s = mpfused.GradScaler()
    assert not s.is_enabled()
    assert mpfused.GradScaler("cpu", enabled=False).state_dict() == {}


def test_optstate_reexport():
    assert mpfused.grad_scaler.OptState is OptState
    assert isinstance(mpfused.GradScaler("cpu"), torch.amp.GradScaler)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_update_never_sync_cuda(dtype):
    model = torch.nn.Linear(64, 64).cuda().to(dtype)
    opt = mpfused.AdamW(model.parameters(), capturable=True, max_grad_norm=1.0)
    s = mpfused.GradScaler("cuda")
    x = torch.randn(8, 64, device="cuda", dtype=dtype)
    for i in range(3):
        opt.zero_grad(set_to_none=False)
        s.scale(model(x).float().sum()).backward()
        if i:  # after the first step has created state and lazy tensors
            torch.cuda.set_sync_debug_mode("error")
        try:
            s.step(opt)
            s.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@cuda_only
def test_graph_capture_step_update():
    """scaler.step(opt); scaler.update() captured in a CUDA graph and replayed (torch's
    test_graph_grad_scaling pattern): scales and skipped steps follow the replayed grads."""
    p = torch.nn.Parameter(torch.ones(4, device="cuda", dtype=torch.bfloat16))
    opt = mpfused.AdamW([p], lr=0.1, capturable=True)
    s = mpfused.GradScaler("cuda", init_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
                           growth_interval=1)
    static_grad = torch.ones(4, device="cuda", dtype=torch.bfloat16)
    p.grad = static_grad
    s.scale(torch.ones((), device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: state, lazy init
        s.step(opt)
        s.update()
    torch.cuda.current_stream().wait_stream(side)
    s.update(4.0)
    g = torch.cuda.CUDAGraph()
    s.scale(torch.ones((), device="cuda"))
    with torch.cuda.graph(g):
        s.step(opt)
        s.update()
    scales, steps = [], []
    for value in (5.0, float("inf"), 5.0, float("nan")):
        static_grad.fill_(value)
        g.replay()
        scales.append(s._scale.item())
        steps.append(opt.state[p]["step"].item())
    assert scales == [8.0, 4.0, 8.0, 4.0]
    assert steps == [2.0, 2.0, 3.0, 3.0]
    assert torch.isfinite(p.float()).all()


def _replace_grads_hook(make):
    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = make(p.grad)
    return hook


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, mpfused.AdamW, mpfused.AdamW8bit],
                         ids=["torch.AdamW", "mpfused.AdamW", "mpfused.AdamW8bit"])
def test_step_pre_hook_grads_decide_the_update(scaler_cls, opt_cls):
    """A step pre-hook that replaces p.grad (compression, projections) decides the update, as
    with torch's scaler and optimizer: zeroed grads move nothing (weight_decay 0). With mpfused's
    scaler and optimizer the grads the hook leaves are also the ones checked for inf/NaN (a hook
    that writes inf skips the step and backs the scale off; one that replaces inf grads by finite
    ones lets the step happen); torch checks (or unscales) before the hooks run."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = opt_cls(model.parameters(), lr=0.1, weight_decay=0.0)
    scaler = scaler_cls("cpu", init_scale=4.0, growth_interval=1)
    handle = opt.register_step_pre_hook(_replace_grads_hook(torch.zeros_like))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 8.0  # a finite step: the scale grows
    handle.remove()
    if scaler_cls is torch.amp.GradScaler or opt_cls is torch.optim.AdamW:
        return

    # the hook's inf is seen: skipped, nothing moves, the scale backs off
    handle = opt.register_step_pre_hook(_replace_grads_hook(
        lambda g: torch.full_like(g, float("inf"))))
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 4.0
    handle.remove()

    # inf in the backward's grads, finite ones from the hook: the step happens
    handle = opt.register_step_pre_hook(_replace_grads_hook(torch.ones_like))
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    model[0].weight.grad.fill_(float("nan"))
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 8.0
    handle.remove()
    for attr in ("grad_scale", "found_inf", "grad_norm_sq", "check_grads"):
        assert not hasattr(opt, attr)


def test_step_pre_hook_grads_are_the_clipped_ones():
    """With fused clipping the norm is taken over the grads the hook leaves: a hook that halves
    the grads gives the same update as grads half as large from the backward."""
    results = []
    for halve_in_hook in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4)
        opt = mpfused.AdamW(model.parameters(), lr=0.1, max_grad_norm=0.01)
        if halve_in_hook:
            opt.register_step_pre_hook(_replace_grads_hook(lambda g: g * 0.5))
        scaler = mpfused.GradScaler("cpu", init_scale=4.0)
        loss = model(torch.randn(3, 6)).sum()
        scaler.scale(loss if halve_in_hook else loss * 0.5).backward()
        scaler.step(opt)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
