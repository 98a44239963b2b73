"""Optimizer state through loads and changes between steps (issue 20, items 5 and 8):

* load_state_dict copies every state tensor (torch's load keeps the state_dict's own tensors
  where dtype and device match; bitsandbytes copies): optimizers loaded from one state_dict, and
  the state_dict itself, never share a tensor;
* master_weights "fp32" <-> "remainder" between steps converts the master exactly: the steps
  after the switch are those of an uninterrupted run, bit for bit; model.float() gives the params
  their masters' value.
"""
from __future__ import annotations

import copy

import pytest
import torch

import mpfused
from mpfused.reference.adam import remainder_join, remainder_split


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _state_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)


def _storages(obj) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _state_tensors(obj) if t.numel()}


MAKERS = {
    "adamw-fp32": (torch.float32, lambda ps: mpfused.AdamW(ps, lr=1e-2)),
    "adamw-bf16-master-amsgrad": (torch.bfloat16,
                                  lambda ps: mpfused.AdamW(ps, lr=1e-2, amsgrad=True)),
    "adam-bf16-remainder": (torch.bfloat16,
                            lambda ps: mpfused.Adam(ps, lr=1e-2, master_weights="remainder")),
    "adamw8bit-bf16": (torch.bfloat16, lambda ps: mpfused.AdamW8bit(ps, lr=1e-2, min_8bit_size=64)),
    "adam8bit-fp32": (torch.float32, lambda ps: mpfused.Adam8bit(ps, lr=1e-2, min_8bit_size=64)),
}


@pytest.mark.parametrize("kind", MAKERS)
def test_load_state_dict_copies_every_state_tensor(kind):
    dtype, make = MAKERS[kind]
    torch.manual_seed(0)
    shapes = [(40, 8), (5,)]  # an 8-bit param and one with fp32 state in the 8-bit optimizers
    src = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    opt = make(src)
    for i in range(2):
        _grads(src, i)
        opt.step()
    sd = opt.state_dict()
    saved = copy.deepcopy(sd)
    loaded = []
    for _ in range(2):
        params = [torch.nn.Parameter(p.detach().clone()) for p in src]
        o = make(params)
        o.load_state_dict(sd)
        loaded.append((params, o))
    (pa, a), (pb, b) = loaded
    live = _storages(dict(opt.state)) | _storages(sd)
    for o in (a, b):
        assert not _storages(dict(o.state)) & live, "a loaded state tensor aliases the source"
    assert not _storages(dict(a.state)) & _storages(dict(b.state))
    for i in range(3):  # a steps; b, the state_dict and the source optimizer do not move
        _grads(pa, 10 + i)
        a.step()
    for got, want in zip(_state_tensors(sd), _state_tensors(saved)):
        assert torch.equal(got, want)
    for p in pb:
        assert b.state[p]["step"].item() == 2.0
    assert all(a.state[p]["step"].item() == 5.0 for p in pa)


def _full_value(opt, p):
    """The fp32 value the optimizer holds for p in either master mode."""
    st = opt.state[p]
    if "master" in st:
        return st["master"]
    return remainder_join(p.detach(), st["master_remainder"])


@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.AdamW8bit])
@pytest.mark.parametrize("first,then", [("fp32", "remainder"), ("remainder", "fp32")])
def test_master_mode_switch_is_exact(cls, first, then):
    """Switched after 3 steps: 4 more steps give the master (the fp32 value) of a run that
    stayed in `first`, bit for bit, and the param as the new mode rounds that value."""
    torch.manual_seed(1)
    init = [torch.randn(64, 80), torch.randn(7)]  # 8-bit and fp32 state in AdamW8bit
    runs = []
    for switch in (True, False):
        ps = [torch.nn.Parameter(t.bfloat16()) for t in init]
        kw = {"min_8bit_size": 64} if cls is mpfused.AdamW8bit else {}
        opt = cls(ps, lr=3e-3, weight_decay=0.1, master_weights=first, **kw)
        for i in range(7):
            if i == 3 and switch:
                opt.param_groups[0]["master_weights"] = then
            _grads(ps, i)
            opt.step()
        runs.append((ps, opt))
    (ps, opt), (ref_ps, ref) = runs
    for p, q in zip(ps, ref_ps):
        assert set(opt.state[p]) & {"master", "master_remainder"} == (
            {"master"} if then == "fp32" else {"master_remainder"})
        want = _full_value(ref, q)
        assert torch.equal(_full_value(opt, p).view(torch.int32), want.view(torch.int32))
        if then == "remainder":  # ties rounded away from zero, as the kernel's split
            assert torch.equal(p.detach().view(torch.int16),
                               remainder_split(want)[0].view(torch.int16))
        else:
            assert torch.equal(p.detach(), want.bfloat16())


@pytest.mark.parametrize("mode", ["fp32", "remainder"])
def test_model_float_takes_the_master_value(mode):
    """bf16 -> fp32 params (model.float()) between steps: an fp32 param is its own master, and it
    continues from the exact master, not from its bf16 rounding."""
    torch.manual_seed(2)
    model = torch.nn.Linear(16, 8).bfloat16()
    opt = mpfused.AdamW(model.parameters(), lr=1e-3, master_weights=mode)
    for i in range(3):
        _grads(list(model.parameters()), i)
        opt.step()
    exact = [_full_value(opt, p).clone() for p in model.parameters()]
    ref = [torch.nn.Parameter(v.clone()) for v in exact]
    o_ref = torch.optim.AdamW(ref, lr=1e-3)
    o_ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # fp32 moments and step counts
    model.float()
    for i in range(2):
        _grads(list(model.parameters()), 10 + i)
        for p, r in zip(model.parameters(), ref):
            r.grad = p.grad.clone()
        opt.step()
        o_ref.step()
    for p, r in zip(model.parameters(), ref):
        assert not {"master", "master_remainder"} & set(opt.state[p])
        torch.testing.assert_close(p.detach(), r.detach())


def test_refresh_after_model_float_keeps_outside_writes():
    """model.float(), then the user writes the params and calls refresh_master_weights(): the
    write stands (the stale masters are dropped, not restored over it)."""
    p = torch.nn.Parameter(torch.randn(32).bfloat16())
    opt = mpfused.AdamW([p], lr=1e-2, weight_decay=0.0, master_weights="remainder")
    _grads([p], 0)
    opt.step()
    p.data = p.data.float()
    with torch.no_grad():
        p.copy_(torch.linspace(-1, 1, 32) + 1e-4)  # not representable in bf16
    written = p.detach().clone()
    opt.refresh_master_weights()
    for key in ("exp_avg", "exp_avg_sq"):
        opt.state[p][key].zero_()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), written)
