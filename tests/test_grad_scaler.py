"""mpfused.GradScaler side by side with torch.amp.GradScaler: the behaviours of PyTorch's CPU
test_grad_scaling_* tests (REFERENCE.md 1.11), run against both classes."""
import copy
import io
import pickle
import warnings

import pytest
import torch

import mpfused
from torch.amp.grad_scaler import OptState

SCALERS = [torch.amp.GradScaler, mpfused.GradScaler]
IDS = ["torch", "mpfused"]


def fixture_models(optim_ctor=torch.optim.SGD, **kw):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaled = copy.deepcopy(model)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (model, optim_ctor(model.parameters(), lr=1.0, **kw), scaled,
            optim_ctor(scaled.parameters(), lr=1.0, **kw), data, torch.nn.MSELoss())


def run_case(scaler_cls, run, enabled=True, skip_iter=2, optim_ctor=torch.optim.SGD, atol=1e-7,
             **kw):
    """torch's _run_scaling_case: control without scaling vs scaled, inf injected at skip_iter."""
    mc, oc, ms, os_, data, loss_fn = fixture_models(optim_ctor, **kw)
    scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled,
                        growth_interval=1)
    run(data, mc, oc, scaler, loss_fn, skip_iter, False)
    run(data, ms, os_, scaler, loss_fn, skip_iter, True)
    if enabled:
        unskipped = len(data) - (1 if skip_iter else 0)
        assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5 ** (1 if skip_iter else 0)
    else:
        assert scaler.get_scale() == 1.0
    for c, s in zip(mc.parameters(), ms.parameters()):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=atol)
    return scaler, ms


def basic_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
@pytest.mark.parametrize("enabled", [True, False])
def test_scaling_basic(scaler_cls, enabled):
    run_case(scaler_cls, basic_run, enabled=enabled)


@pytest.mark.parametrize("optim_ctor", [mpfused.AdamW, mpfused.Adam,
                                        lambda p, lr: torch.optim.AdamW(p, lr=lr, fused=True)],
                         ids=["mpfused.AdamW", "mpfused.Adam", "torch.AdamW-fused"])
@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_fused_optimizers(scaler_cls, optim_ctor):
    """_step_supports_amp_scaling path: in-kernel unscale, skip on inf, no host sync needed."""
    run_case(scaler_cls, basic_run, optim_ctor=lambda p, lr: optim_ctor(p, lr=0.01), atol=1e-6)


def test_same_trajectory_both_scalers():
    """Same scale trajectory, same skipped steps, same params, inf injected at chosen steps."""
    results = []
    for cls in SCALERS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=3)
        scales, params = [], None
        g = torch.Generator().manual_seed(5)
        for i in range(25):
            x = torch.randn(8, 16, generator=g)
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            if i in (4, 5, 11, 20):
                model[2].bias.grad[i % 4] = float("nan") if i % 2 else float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, [p.detach().clone() for p in model.parameters()],
                        [opt.state[p]["step"].item() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert results[0][2] == results[1][2] == [21.0] * 4
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_clipping(scaler_cls):
    max_norm = 0.2

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_case(scaler_cls, run, atol=1e-5)


@pytest.mark.parametrize("clip", [torch.nn.utils.clip_grad_norm_, mpfused.clip_grad_norm_],
                         ids=["torch-clip", "mpfused-clip"])
@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_clipping_separate_unscale(scaler_cls, clip):
    max_norm = 0.2

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                clip(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                clip(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_case(scaler_cls, run)


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_accumulation(scaler_cls):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    mc, oc, ms, os_, data, loss_fn = fixture_models()
    scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    run(data, mc, oc, scaler, loss_fn, 0, False)
    run(data, ms, os_, scaler, loss_fn, 0, True)
    assert scaler.get_scale() == 128.0 * 2.0**2
    for c, s in zip(mc.parameters(), ms.parameters()):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_penalty(scaler_cls):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv = 1.0 / scaler.get_scale()
                grads = [g * inv for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            penalty = sum(g.pow(2).sum() for g in grads).sqrt()
            loss = loss + penalty
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_case(scaler_cls, run)


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_scaling_multiple(scaler_cls):
    torch.manual_seed(0)
    mc0, oc0, ms0, os0, data, loss_fn = fixture_models()
    mc1, oc1, ms1, os1, _, _ = fixture_models()
    scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)

    def run(m0, m1, o0, o1, try_scaling_api):
        for i, (x, y) in enumerate(data):
            o0.zero_grad()
            o1.zero_grad()
            out0, out1 = m0(x), m1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == 2:
                    m1[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(o0)
                scaler.step(o0)
                scaler.step(o1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                o0.step()
                if i != 2:
                    o1.step()

    run(mc0, mc1, oc0, oc1, False)
    run(ms0, ms1, os0, os1, True)
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5
    for c, s in zip(list(mc0.parameters()) + list(mc1.parameters()),
                    list(ms0.parameters()) + list(ms1.parameters())):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_pickle(scaler_cls):
    a = scaler_cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    for lazy_init in (False, True):
        if lazy_init:
            a.scale(torch.tensor([4.0]))
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() and b.get_scale() == 3.0 and b.get_growth_factor() == 4.0
        assert b.get_backoff_factor() == 0.5 and b.get_growth_interval() == 2
        assert b._init_growth_tracker == 0
        assert b.scale(torch.tensor([4.0])).item() == 12.0


@pytest.mark.parametrize("src,dst", [(0, 1), (1, 0), (1, 1)], ids=["torch->mp", "mp->torch", "mp->mp"])
@pytest.mark.parametrize("lazy_init", [False, True])
def test_state_dict_interchange(src, dst, lazy_init):
    s0 = SCALERS[src]("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = SCALERS[dst]("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if lazy_init:
        s1.scale(torch.full((1,), 4.0))
    sd = s0.state_dict()
    assert set(sd) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    s1.load_state_dict(torch.load(buf, weights_only=True))
    assert s1.get_scale() == 3.0 and s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5 and s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0
    if lazy_init:
        assert isinstance(s1._scale, torch.FloatTensor)


def test_state_dict_values_after_training_match():
    sds = []
    for cls in SCALERS:
        scaler, _ = run_case(cls, basic_run)
        sds.append(scaler.state_dict())
    assert sds[0] == sds[1]


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_errors_match_torch(scaler_cls):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = scaler_cls("cpu")
    with pytest.raises(AssertionError, match="_scale is None"):
        s.unscale_(opt)
    s.scale(model(torch.randn(2, 4)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        s.step(opt, closure=lambda: 0)
    s.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        s.unscale_(opt)
    s.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        s.update()
    half = torch.nn.Linear(4, 4).half()
    hopt = torch.optim.SGD(half.parameters(), lr=0.1)
    s.scale(half(torch.randn(2, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        s.unscale_(hopt)
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})


@pytest.mark.parametrize("optim", [torch.optim.SGD, mpfused.AdamW], ids=["SGD", "mpfused.AdamW"])
@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_no_grads(scaler_cls, optim):
    model = torch.nn.Linear(4, 4)
    opt = optim(model.parameters(), lr=0.1)
    s = scaler_cls("cpu")
    s.scale(torch.ones(()))
    if optim is torch.optim.SGD:  # default path asserts; the fused path steps, update asserts
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            s.step(opt)
    else:
        s.step(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            s.update()


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_will_not_overflow(scaler_cls):
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    s = scaler_cls("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
    opt.zero_grad()
    s.scale(model(torch.randn(1, 5)).sum()).backward()
    s.step(opt)
    s.update()
    assert s._scale != float("inf") and s._scale != float("nan")


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_pass_itself(scaler_cls):
    class Legacy(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None, *, grad_scaler=None):
            assert grad_scaler is not None
            assert not hasattr(self, "grad_scale")

    class Current(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)

    x = torch.randn(4, 4)
    m = torch.nn.Linear(4, 1)
    s = scaler_cls("cpu")
    o1 = Legacy(m.parameters())
    s.scale(m(x).sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        s.step(o1)
    s = scaler_cls("cpu")
    o2 = Current(m.parameters())
    s.scale(m(x).sum()).backward()
    s.step(o2)
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


def test_unscale_sparse():
    s = mpfused.GradScaler("cpu")
    s.scale(torch.ones(()))
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p], lr=0.1)
    i = torch.tensor([[0, 1, 1]])
    for values, expect in (([16.0, 32.0, 64.0], 0.0), ([16.0, float("inf"), 64.0], 1.0)):
        p.grad = torch.sparse_coo_tensor(i, torch.tensor(values), (8,))
        found = s._unscale_grads_(opt, torch.tensor(0.25), torch.zeros(()), False)
        assert list(found.values())[0].item() == expect
    # uncoalesced fp16 duplicates 64000 + 64000 overflow fp16 only when coalesced
    p16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    opt16 = torch.optim.SGD([p16], lr=0.1)
    p16.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([64000.0, 64000.0]).half(), (8,))
    found = s._unscale_grads_(opt16, torch.tensor(1.0), torch.zeros(()), True)
    assert list(found.values())[0].item() == 1.0


@pytest.mark.parametrize("scaler_cls", SCALERS, ids=IDS)
def test_params_invalidated_between_unscale_and_step(scaler_cls):
    """H3: inf written after unscale_ is applied (torch pins this behaviour)."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = scaler_cls("cpu")
    s.scale(model(torch.randn(2, 4)).sum()).backward()
    s.unscale_(opt)
    model.weight.grad.fill_(float("inf"))
    s.step(opt)
    assert not torch.isfinite(model.weight).all()


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
