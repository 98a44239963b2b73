"""mpfused.GradScaler side by side with torch.amp.GradScaler: the behaviours of PyTorch's CPU
test_grad_scaling_* tests (REFERENCE.md 1.11), run against both classes: the scaling runs. More of
the same comparison: tests/test_grad_scaler_api.py; mpfused's own behaviours:
tests/test_grad_scaler_mpfused.py."""
import copy

import pytest
import torch

import mpfused

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
