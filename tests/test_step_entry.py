"""FusedOptimizer.step's entry (mpfused/optim/_step_entry.py): torch's wrapper semantics on the lean
path (hooks, argument rewriting, grad mode), torch's wrapper under a profiler, the same result
bit for bit on both paths."""
import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import mpfused
from mpfused.optim import _step_entry


def _opt(cls=mpfused.Lion4bit, n=5000, **kw):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(torch.bfloat16))
    p.grad = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    return cls([p], lr=1e-3, min_8bit_size=0, master_weights="remainder8", **kw), p


def _state(opt, p):
    return [p.detach().clone()] + [v.clone() for v in opt.state[p].values()
                                    if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("cls,kw", [(mpfused.Lion4bit, {}), (mpfused.SGD8bit, {"momentum": 0.9}),
                                    (mpfused.AdamW4bit, {})])
def test_torch_path_and_lean_path_agree_bitwise(cls, kw, monkeypatch):
    a, pa = _opt(cls, **kw)
    b, pb = _opt(cls, **kw)
    for _ in range(3):
        a.step()
    monkeypatch.setattr(_step_entry, "_profiler_enabled", lambda: True)
    monkeypatch.setattr(_step_entry, "_NO_GRAPH_CAPTURE", [False])
    for _ in range(3):
        b.step()
    for x, y in zip(_state(a, pa), _state(b, pb)):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def test_hooks_order_and_argument_rewrite():
    opt, _ = _opt()
    calls = []
    closure_seen = []

    def closure():
        closure_seen.append(torch.is_grad_enabled())
        return torch.tensor(1.5)

    def pre(o, args, kwargs):
        calls.append(("pre", o is opt, len(args)))
        return (o,), {"closure": closure}  # rewrites the call: the step gets the closure
    h = [opt.register_step_pre_hook(pre),
         opt.register_step_post_hook(lambda o, a, k: calls.append(("post", "closure" in k))),
         register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global_pre",))),
         register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global_post",)))]
    try:
        loss = opt.step()
    finally:
        for x in h:
            x.remove()
    assert calls == [("global_pre",), ("pre", True, 1), ("post", True), ("global_post",)]
    assert closure_seen == [True] and float(loss) == 1.5

    def bad(o, args, kwargs):
        return 3
    h = opt.register_step_pre_hook(bad)
    try:
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            opt.step()
    finally:
        h.remove()


def test_grad_mode_off_inside_and_restored():
    opt, p = _opt()
    seen = []
    orig = type(opt)._launch

    def launch(self, *a, **k):
        seen.append(torch.is_grad_enabled())
        return orig(self, *a, **k)
    type(opt)._launch = launch
    try:
        opt.step()
        with torch.no_grad():
            opt.step()
            assert not torch.is_grad_enabled()
    finally:
        type(opt)._launch = orig
    assert seen == [False, False] and torch.is_grad_enabled()
    p.grad = None
    opt.step()  # no grad: nothing to do, grad mode still restored
    assert torch.is_grad_enabled()


def test_step_is_not_rewrapped_and_profiler_sees_it():
    opt, _ = _opt()
    assert getattr(type(opt).step, "hooked", False)
    assert type(opt).step is mpfused.optim.engine.FusedOptimizer.step  # torch left it alone
    with torch.profiler.profile() as prof:
        opt.step()
    names = {e.key for e in prof.key_averages()}
    assert "Optimizer.step#Lion4bit.step" in names
    assert any(n.startswith("mpfused::lion4bit_step_") for n in names)
