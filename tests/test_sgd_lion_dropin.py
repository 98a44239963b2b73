"""SGD, Lion, SGD8bit and Lion8bit as drop-ins (issue 22): bad constructor arguments raise what
the peer raises (exception type and full message), a torch.optim.SGD continues from mpfused.SGD's
state_dict (and torch < 2.1's ``momentum_buffer: None`` loads), and an LR scheduler's lr reaches
every step's kernel (float and tensor lr).

Peers: torch.optim.SGD for SGD and SGD8bit; bitsandbytes' Lion / Lion8bit for ours (torch has
no Lion). Documented differences, pinned here:
* SGD8bit without momentum raises NotImplementedError before any other check, as bitsandbytes'
  SGD8bit does (the 8-bit state is the momentum buffer), so torch's checks only apply with a
  momentum.
* Lion accepts a beta of exactly 1.0 (lion-pytorch's rule ``0 <= beta <= 1``); bitsandbytes
  requires ``beta < 1``.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import mpfused
from tests.tolerances import TRAJ_TOL

SGD_BAD = [dict(lr=-1.0), dict(momentum=-0.5), dict(weight_decay=-0.1), dict(nesterov=True),
           dict(momentum=0.9, dampening=0.1, nesterov=True), dict(lr=torch.tensor([1e-3, 1e-3])),
           dict(fused=True, foreach=True), dict(fused=True, differentiable=True),
           dict(lr=torch.tensor(0.01)), dict(momentum=0.9, nesterov=True)]  # the last two: fine
LION_BAD = [dict(lr=-1.0), dict(lr=float("nan")), dict(betas=(1.5, 0.99)),
            dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1), dict(betas=(0.5, 0.9))]


def _outcome(cls, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cls([torch.nn.Parameter(torch.randn(2))], **kwargs)
        except Exception as e:  # noqa: BLE001
            return type(e), str(e)
    return None


@pytest.mark.parametrize("kwargs", SGD_BAD, ids=str)
def test_sgd_constructor_errors_as_torch(kwargs):
    expected = _outcome(torch.optim.SGD, **kwargs)
    assert _outcome(mpfused.SGD, **kwargs) == expected
    # SGD8bit with a momentum (it needs one): torch's outcome for the same arguments
    with_momentum = {"momentum": 0.9, **kwargs}
    assert _outcome(mpfused.SGD8bit, **with_momentum) == _outcome(torch.optim.SGD,
                                                                  **with_momentum)
    # without one: bitsandbytes' NotImplementedError before any other check, as bitsandbytes
    if "momentum" not in kwargs:
        err = _outcome(mpfused.SGD8bit, **kwargs)
        assert err[0] is NotImplementedError and "SGD without momentum" in err[1], err


@pytest.mark.parametrize("kwargs", LION_BAD, ids=str)
def test_lion_constructor_errors_as_bitsandbytes(kwargs):
    bnb = pytest.importorskip("bitsandbytes")
    for ours, theirs in ((mpfused.Lion, bnb.optim.Lion), (mpfused.Lion8bit, bnb.optim.Lion8bit)):
        assert _outcome(ours, **kwargs) == _outcome(theirs, **kwargs), ours.__name__


def test_lion_beta_one_is_lion_pytorchs_rule():
    bnb = pytest.importorskip("bitsandbytes")
    assert _outcome(bnb.optim.Lion, betas=(1.0, 0.99))[0] is ValueError
    for cls in (mpfused.Lion, mpfused.Lion8bit):
        assert _outcome(cls, betas=(1.0, 1.0)) is None
        assert _outcome(cls, betas=(1.0 + 1e-7, 0.99)) == (
            ValueError, f"Invalid beta parameter at index 0: {1.0 + 1e-7}")


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ((13, 7), (31,), (4100,))]


def _grads(params, gen):
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


@pytest.mark.parametrize("kw", [dict(momentum=0.9, nesterov=True, weight_decay=0.1),
                                dict(momentum=0.9, dampening=0.3, maximize=True), dict()],
                         ids=["nesterov", "dampening-maximize", "plain"])
def test_torch_sgd_continues_from_mpfused_state_dict(kw):
    """mpfused.SGD's state_dict loads into torch.optim.SGD (its keys and layout; torch ignores
    our step counter) and torch's next steps are those mpfused.SGD takes."""
    ours = _params()
    opt = mpfused.SGD(ours, lr=0.05, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, g in zip(ours, _grads(ours, gen)):
            p.grad = g
        opt.step()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    o_torch = torch.optim.SGD(twin, lr=0.05, foreach=False, **kw)
    o_torch.load_state_dict(copy.deepcopy(opt.state_dict()))
    if kw.get("momentum"):
        assert torch.equal(o_torch.state[twin[0]]["momentum_buffer"],
                           opt.state[ours[0]]["momentum_buffer"])
    for _ in range(3):
        for p, q, g in zip(ours, twin, _grads(ours, gen)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        o_torch.step()
    for a, b in zip(twin, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


def test_torch_legacy_none_momentum_buffer_loads():
    """torch < 2.1 saved ``momentum_buffer: None`` for momentum 0: mpfused.SGD loads it (no buffer,
    its counter starts at 0) and steps as torch.optim.SGD."""
    ours, ref = _params(), _params()
    sd = {"state": {i: {"momentum_buffer": None} for i in range(len(ours))},
          "param_groups": [dict(lr=0.05, momentum=0, dampening=0, weight_decay=0.1,
                                nesterov=False, maximize=False, foreach=None,
                                differentiable=False, fused=None, params=[0, 1, 2])]}
    opt = mpfused.SGD(ours, lr=0.05, weight_decay=0.1)
    opt.load_state_dict(sd)
    o_ref = torch.optim.SGD(ref, lr=0.05, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        for p, q, g in zip(ours, ref, _grads(ours, gen)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        o_ref.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
    # adopted at the first step: no buffer, a counter that started at 0
    assert all(set(opt.state[p]) == {"step"} and opt.state[p]["step"].item() == 2 for p in ours)


SCHEDULED = {
    "sgd": (mpfused.SGD, dict(momentum=0.9, weight_decay=0.1)),
    "lion": (mpfused.Lion, dict(weight_decay=0.1)),
    "sgd8bit": (mpfused.SGD8bit, dict(momentum=0.9, min_8bit_size=256)),
    "lion8bit": (mpfused.Lion8bit, dict(weight_decay=0.1, min_8bit_size=256)),
}


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", list(SCHEDULED))
def test_lr_scheduler_reaches_every_step(name, tensor_lr):
    """A scheduled run (OneCycleLR: a new lr, and a new momentum / beta1, every step) equals, bit
    for bit, a run whose hyperparameters are written into the group by hand before each step:
    the kernels read the group's current values, never ones cached in a plan; a tensor lr
    written in place by the scheduler is read as well."""
    cls, kw = SCHEDULED[name]
    runs = []
    for by_hand in (False, True):
        params = _params(torch.bfloat16)
        opt = cls(params, lr=torch.tensor(1e-2) if tensor_lr else 1e-2, **kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=6)
        group, seen = opt.param_groups[0], []
        gen = torch.Generator().manual_seed(2)
        for step in range(5):
            for p, g in zip(params, _grads(params, gen)):
                p.grad = g
            if by_hand:
                for key, value in runs[0][1][step].items():
                    group[key] = (torch.tensor(value) if key == "lr" and tensor_lr else value)
            seen.append({k: (float(group[k]) if k == "lr" else copy.deepcopy(group[k]))
                         for k in ("lr", "momentum", "betas") if k in group})
            opt.step()
            if not by_hand:
                sched.step()
        state = [t.clone() for s in opt.state.values() for t in s.values()]
        runs.append(([p.detach().clone() for p in params] + state, seen))
    assert len({h["lr"] for h in runs[0][1]}) == 5  # the scheduler changed the lr every step
    assert len({str(h.get("momentum", h.get("betas"))) for h in runs[0][1]}) > 1  # cycled too
    assert runs[0][1] == runs[1][1]
    scheduled, by_hand = runs[0][0], runs[1][0]
    assert len(scheduled) == len(by_hand)
    assert all(torch.equal(a, b) for a, b in zip(scheduled, by_hand))
