"""The engine's step contract for SGD, Lion, SGD8bit and Lion8bit (issue 22, "Every one of
them"): one kernel launch per (device, dtype, state kind) group, no host sync in a step (scaler,
clipping and a tensor lr included), and fused clipping of the 8-bit classes equal to
``clip_grad_norm_`` then a step. The 32-bit classes' fused clipping: tests/test_sgd_lion.py."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import mpfused
from mpfused.ops.bound import BoundOp

CLASSES = {
    "sgd": (mpfused.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
    "lion": (mpfused.Lion, dict(weight_decay=0.1)),
    "sgd8bit": (mpfused.SGD8bit, dict(momentum=0.9, weight_decay=0.1, min_8bit_size=256)),
    "lion8bit": (mpfused.Lion8bit, dict(weight_decay=0.1, min_8bit_size=256)),
}
# per dtype: two params with 8-bit state under min_8bit_size=256 (one of several blocks, one
# with a short last block) and two small ones with fp32 state
SHAPES = ((40, 30), (300,), (7, 5), (0,))


def _params(dtypes=(torch.float32, torch.bfloat16)):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(dt)) for dt in dtypes for s in SHAPES]


def _grads(params, gen, scale=1.0):
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


@pytest.mark.parametrize("name", list(CLASSES))
def test_one_launch_per_dtype_and_state_kind(name, monkeypatch):
    """Eight params of two dtypes: one launch per dtype (32-bit classes); per dtype and state
    kind (8-bit classes: the 8-bit op for the large params, the 32-bit op for the small)."""
    cls, kw = CLASSES[name]
    calls = Counter()
    call = BoundOp.__call__

    def counting(self, grads, *rest, **k):
        calls[(self.op.name, grads[0].dtype, len(grads))] += 1
        return call(self, grads, *rest, **k)

    monkeypatch.setattr(BoundOp, "__call__", counting)
    params = _params()
    opt = cls(params, lr=1e-2, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads(params, gen)
        opt.step()
    base = name.replace("8bit", "")
    if name.endswith("8bit"):
        want = {(f"{name}_step_", dt, 2): 3 for dt in (torch.float32, torch.bfloat16)}
        want.update({(f"{base}_step_", dt, 2): 3 for dt in (torch.float32, torch.bfloat16)})
    else:
        want = {(f"{base}_step_", dt, 4): 3 for dt in (torch.float32, torch.bfloat16)}
    assert dict(calls) == want


@pytest.mark.parametrize("backend", [None, "triton"], ids=["auto", "triton"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_no_host_sync_in_a_step(name, backend, monkeypatch):
    """scaler.step(opt) and update() with fused clipping and a tensor lr read every scalar on
    device: no .item() / bool() / float() of a tensor once the state exists (an inf step
    included); the params equal an unpatched twin's."""
    cls, kw = CLASSES[name]
    runs = []
    for patched in (False, True):
        params = _params()
        opt = cls(params, lr=torch.tensor(1e-2), max_grad_norm=1.0, backend=backend, **kw)
        scaler = mpfused.GradScaler("cpu", init_scale=2.0**4, backend=backend)
        gen = torch.Generator().manual_seed(2)
        for i in range(3):
            _grads(params, gen, scale=2.0**4)
            if i == 1:
                params[0].grad[0, 0] = float("inf")
            if i == 1 and patched:
                def boom(*a, **k):
                    raise AssertionError("host sync in a step")

                for attr in ("item", "tolist", "__bool__", "__float__", "__int__"):
                    monkeypatch.setattr(torch.Tensor, attr, boom)
            scaler.scale(torch.zeros(()))
            scaler.step(opt)
            scaler.update()
        monkeypatch.undo()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("name", ["sgd8bit", "lion8bit"])
def test_8bit_fused_clipping_equals_clip_then_step(name):
    """max_grad_norm= under a GradScaler: the params follow clip_grad_norm_ on the unscaled grads
    then a plain step (the norm's sum of squares is added in another order: last-bit
    differences of the clip coefficient, hence the fp32 tolerance; fp32 params, as torch's
    clip_grad_norm_ of bf16 grads rounds the norm and the clipped grads to bf16)."""
    cls, kw = CLASSES[name]
    fused, ref = _params([torch.float32]), _params([torch.float32])
    o_fused = cls(fused, lr=1e-2, max_grad_norm=0.5, **kw)
    o_ref = cls(ref, lr=1e-2, **kw)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        _grads(ref, gen, scale=3.0)
        for p, q in zip(fused, ref):
            p.grad = q.grad * 2.0**8  # as scaler.scale(loss).backward() would (exact)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        scaler.scale(torch.zeros(()))
        scaler.step(o_fused)
        scaler.update()
        o_ref.step()
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)
