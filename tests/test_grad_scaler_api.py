"""mpfused.GradScaler side by side with torch.amp.GradScaler (as tests/test_grad_scaler.py): pickle,
state_dict interchange, errors, no grads, overflow, passing itself, sparse grads, invalidated params
(moved from tests/test_grad_scaler.py)."""
import io
import pickle

import pytest
import torch

import mpfused
from tests.test_grad_scaler import IDS, SCALERS, basic_run, run_case


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
