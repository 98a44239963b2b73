"""GradScaler hysteresis (issue 20, item 9): ``hysteresis=N`` is Megatron's / DeepSpeed's rule
(N overflows since the scale last grew back it off, the budget refilled only by growth) and
``consecutive_hysteresis=True`` is DeepSpeed's option (any step without overflow refills it:
only N overflows in a row back off). Every backend of update_scale_ against a model written from
that description, and the scaler's constructor, state_dict and pickling."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import mpfused
from mpfused.ops import OPS

OP_UNDER_TEST = "update_scale_"  # conftest parametrizes (device, backend) over its backends


def _deepspeed_model(seq, scale, interval, hysteresis, consecutive, growth=2.0, backoff=0.5):
    """DeepSpeed's DynamicLossScaler.update_scale as documented: on overflow, back off when the
    remaining hysteresis is 1 (else spend one); without overflow, refill if consecutive, and
    grow every `interval` clean steps since the last overflow (refilling if not consecutive)."""
    cur_h, clean, out = hysteresis, 0, []
    for overflow in seq:
        if overflow:
            if hysteresis == 1 or cur_h == 1:
                scale *= backoff
            else:
                cur_h -= 1
            clean = 0
        else:
            if consecutive:
                cur_h = hysteresis
            clean += 1
            if clean % interval == 0:
                if not consecutive:
                    cur_h = hysteresis
                scale *= growth
        out.append(scale)
    return out


SEQUENCES = [
    [1, 0, 1, 0, 1, 0, 1, 0, 1],     # isolated overflows: only Megatron's rule backs off
    [1, 1, 0, 1, 1, 1, 0, 0, 0, 1],  # runs of overflows
    [0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0],
]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis,interval", [(2, 4), (3, 3), (1, 2)])
@pytest.mark.parametrize("seq", SEQUENCES)
def test_update_scale_hysteresis_rule(device, backend, consecutive, hysteresis, interval, seq):
    scale = torch.full((), 1024.0, device=device)
    growth = torch.zeros((), dtype=torch.int32, device=device)
    tracker = torch.full((), hysteresis, dtype=torch.int32, device=device)
    got = []
    for overflow in seq:
        OPS["update_scale_"](scale, growth, tracker, torch.tensor(float(overflow), device=device),
                             growth_factor=2.0, backoff_factor=0.5, growth_interval=interval,
                             hysteresis=hysteresis, min_scale=0.0, max_scale=float("inf"),
                             consecutive_hysteresis=consecutive,
                             backend=backend)
        got.append(scale.item())
    assert got == _deepspeed_model(seq, 1024.0, interval, hysteresis, consecutive)


def test_isolated_overflows_back_off_without_consecutive():
    """The documented difference between the two rules, in numbers: hysteresis=2 and an
    overflow every other step."""
    seq = [1, 0, 1, 0, 1, 0]
    assert _deepspeed_model(seq, 8.0, 100, 2, consecutive=False) == [8, 8, 4, 4, 2, 2]
    assert _deepspeed_model(seq, 8.0, 100, 2, consecutive=True) == [8] * 6


def _drive(scaler, pattern):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mpfused.AdamW([p])
    out = []
    for bad in pattern:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([float("inf") if bad else 1.0, 0.0])
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.parametrize("consecutive", [False, True])
def test_grad_scaler_consecutive_hysteresis(consecutive):
    s = mpfused.GradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=2,
                           consecutive_hysteresis=consecutive)
    assert s.get_consecutive_hysteresis() is consecutive
    pattern = [1, 0, 1, 0, 1, 1]
    assert _drive(s, pattern) == _deepspeed_model(pattern, 64.0, 100, 2, consecutive)


def test_consecutive_hysteresis_checkpoint_and_pickle():
    s = mpfused.GradScaler("cpu", init_scale=64.0, hysteresis=3, consecutive_hysteresis=True)
    _drive(s, [1, 0, 1])
    sd = s.state_dict()
    assert sd["consecutive_hysteresis"] is True and sd["hysteresis"] == 3
    for restored in (_loaded(sd), pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert restored.get_consecutive_hysteresis() is True
        assert _drive(restored, [1, 0, 1, 1]) == _drive(copy.deepcopy(s), [1, 0, 1, 1])
    # only the option set: still saved (the defaults give torch's exact 5 keys)
    only = mpfused.GradScaler("cpu", consecutive_hysteresis=True)
    only.scale(torch.ones(()))
    assert only.state_dict()["consecutive_hysteresis"] is True
    assert set(mpfused.GradScaler("cpu").state_dict()) == set(torch.amp.GradScaler("cpu").state_dict())
    old = dict(sd)  # a checkpoint from before the option: Megatron's rule
    del old["consecutive_hysteresis"]
    assert _loaded(old).get_consecutive_hysteresis() is False
    torch.amp.GradScaler("cpu").load_state_dict(sd)  # torch reads the keys it knows


def _loaded(sd):
    t = mpfused.GradScaler("cpu")
    t.load_state_dict(sd)
    return t


def test_consecutive_hysteresis_must_be_bool():
    with pytest.raises(ValueError, match="consecutive_hysteresis must be a bool"):
        mpfused.GradScaler("cpu", consecutive_hysteresis=1)
