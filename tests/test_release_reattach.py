"""GradRelease.reattach(): a removed release handle attached again keeps its buckets, plans and
armed calls; training that switches between release and the ordinary step every step (what
benchmarks/bench_release_toggle.py does to time both on one model) equals the ordinary step bit
for bit, with a param group added while detached; misuse is refused."""
import pytest
import torch

import mpfused
from tests.test_release import CASES, _assert_identical, _loss, _model, _snapshot


def _train(case, toggle: bool, steps=8):
    cls, dtype, kwargs = CASES[case]
    model = _model(dtype)
    params = list(model.parameters())
    opt = cls(params[:-2], lr=1e-2, **kwargs)
    handle = mpfused.step_in_backward(opt, bucket_bytes=2048) if toggle else None
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        if step == 3:  # a group added while detached (odd steps run detached)
            opt.add_param_group({"params": params[-2:], "lr": 5e-3})
        if toggle and step % 2 == 0 and step:
            assert handle.reattach() is handle
        _loss(model, torch.randn(6, 24, generator=gen).to(dtype)).backward()
        opt.step()
        opt.zero_grad()
        for g in opt.param_groups:  # a new lr every step (LambdaLR takes no group added later)
            g["lr"] = g["lr"] * 0.9
        if toggle and step % 2 == 0:
            assert all(p.grad is None for p in params[:-2])
            handle.remove()
    return _snapshot(model, opt), handle


@pytest.mark.parametrize("case", ["AdamW-bf16-master", "AdamW-bf16-remainder", "AdamW-fp32"])
def test_toggled_release_equals_the_ordinary_step(case):
    a, handle = _train(case, True)
    b, _ = _train(case, False)
    _assert_identical(a, b)
    assert any(c.armed is not None for c in handle._chunks)  # the armed calls served
    assert len(handle._group_base) == 3  # the added group got release buckets


def test_reattach_refuses_misuse_and_fsdp():
    model = _model(torch.bfloat16)
    opt = mpfused.AdamW(model.parameters())
    first = mpfused.step_in_backward(opt)
    with pytest.raises(RuntimeError, match="this handle is attached"):
        first.reattach()
    first.remove()
    second = mpfused.step_in_backward(opt)
    with pytest.raises(RuntimeError, match="has gradient release attached"):
        first.reattach()
    second.remove()
    first.reattach()
    first.remove()
    first._fsdp = object()  # (as a handle made with fsdp=...)
    with pytest.raises(RuntimeError, match="not under FSDP2"):
        first.reattach()
    first._fsdp = None
    first.reattach()
    _loss(model, torch.randn(2, 24).bfloat16()).backward()
    assert all(p.grad is None for p in model.parameters())  # released
