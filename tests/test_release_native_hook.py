"""Gradient release's native grad-ready hook (``mpfused._C.ReadyHook``,
csrc/bindings/release_hook.cpp) against the Python hook it stands for (release.py's
``on_grad_ready``, what a pure-Python install runs): the same training, bit for bit, through
what the hook decides (a backward's start, a nested and a failed backward, accumulation, a
bucket that must take the general path, a skipped bucket); the same error; no leak."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import mpfused
from mpfused import _extension
from mpfused.optim import release as release_module
from tests.test_release import _assert_identical, _model, _snapshot

pytestmark = pytest.mark.skipif(
    getattr(_extension.load(), "ReadyHook", None) is None, reason="needs the native extension")

HOOKS = dict(argvalues=["native", "python"], ids=["native", "python"])


@pytest.fixture
def hook_kind(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(release_module, "_native_hook", lambda: None)
    return request.param


def _hooks(param):
    return list((param._post_accumulate_grad_hooks or {}).values())


@pytest.mark.parametrize("hook_kind", **HOOKS, indirect=True)
def test_the_hook_kind(hook_kind):
    model = _model(torch.float32)
    mpfused.step_in_backward(mpfused.AdamW(model.parameters()))
    kinds = {type(h).__name__ for p in model.parameters() for h in _hooks(p)}
    assert kinds == ({"ReadyHook"} if hook_kind == "native" else {"function"})


def _train(worker_threads, steps=7):
    """A run through every decision of the hook: an LR scheduler, a reentrant checkpoint in
    the middle, two micro-batches under accumulate(), a NaN grad on step 3 (its bucket
    skipped), a backward that raises on step 5 (a tensor hook), a param left without a grad on
    step 6 (its bucket takes the general path). Returns the snapshots and release.skipped per
    step."""
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    head, middle, tail = model[:2], model[2:4], model[4:]
    opt = mpfused.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    release = mpfused.step_in_backward(opt, bucket_bytes=2048, worker_threads=worker_threads)
    gen = torch.Generator().manual_seed(5)
    skipped = []

    def loss_of(x, drop_tail_bias=False):
        h = checkpoint(middle, head(x), use_reentrant=True)
        out = torch.nn.functional.linear(h, tail[0].weight,
                                         None if drop_tail_bias else tail[0].bias)
        return out.float().square().mean()

    for step in range(steps):
        x = torch.randn(5, 24, generator=gen).bfloat16()
        with release.accumulate():
            loss_of(x[:2]).backward()
        loss = loss_of(x[2:], drop_tail_bias=step == 6)
        if step == 3:
            loss = loss + params[0].float().sum() * float("nan")
        if step == 5:
            def fail(grad):
                raise RuntimeError("a failing backward")
            handle = params[2].register_hook(fail)
            with pytest.raises(RuntimeError, match="a failing backward"):
                loss.backward()
            handle.remove()
            opt.zero_grad()
        else:
            loss.backward()
            skipped.append(int(release.skipped))
        opt.step()
        opt.zero_grad()
        sched.step()
    return _snapshot(model, opt), skipped


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
def test_native_hook_equals_the_python_hook(worker_threads, monkeypatch):
    native = _train(worker_threads)
    monkeypatch.setattr(release_module, "_native_hook", lambda: None)
    python = _train(worker_threads)
    _assert_identical(native[0], python[0])
    assert native[1] == python[1]
    assert native[1][3] > 0 and sum(native[1]) == native[1][3]  # (the NaN's bucket only)


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
@pytest.mark.parametrize("hook_kind", **HOOKS, indirect=True)
def test_a_failing_update_raises_from_the_backward(hook_kind, worker_threads):
    """A grad the update refuses (a hook registered before the release's makes it float32 on a
    bf16 param that allows any grad dtype): the backward raises the update's error,
    RuntimeError, with either hook (on the worker: at the backward's end)."""
    model = _model(torch.bfloat16)
    if not hasattr(model[0].weight, "grad_dtype"):
        pytest.skip("needs Tensor.grad_dtype (torch >= 2.10)")
    to_float = []

    def hook(p):
        if to_float:
            p.grad = p.grad.float()
    for p in model.parameters():  # (hooks run in the order they were registered)
        p.grad_dtype = None
        p.register_post_accumulate_grad_hook(hook)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    mpfused.step_in_backward(opt, bucket_bytes=1 << 20, worker_threads=worker_threads)
    x = torch.randn(3, 24).bfloat16()
    for _ in range(2):  # (the first step plans; from the second the armed calls serve)
        model(x).float().sum().backward()
        opt.step()
    to_float.append(True)
    with pytest.raises(RuntimeError, match="dtype"):
        model(x).float().sum().backward()


class _FailingCheck(TorchDispatchMode):
    """A Python dispatch mode whose kernel for the release's check raises a ValueError."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "check_grads" in str(func):
            raise ValueError("a failing check")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
@pytest.mark.parametrize("hook_kind", **HOOKS, indirect=True)
def test_an_error_keeps_its_type(hook_kind, worker_threads):
    """An error raised by a Python kernel inside the update (a dispatch mode) reaches the
    backward's caller as it was raised, with either hook (the native one leaves updates under
    a dispatch mode to the Python path)."""
    model = _model(torch.float32)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    mpfused.step_in_backward(opt, bucket_bytes=2048, worker_threads=worker_threads)
    x = torch.randn(4, 24)
    for _ in range(2):  # (the first step plans; from the second the armed calls serve)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(ValueError, match="a failing check"), _FailingCheck():
        model(x).square().mean().backward()


@pytest.mark.parametrize("hook_kind", **HOOKS, indirect=True)
def test_removed_hooks_leave_nothing_alive(hook_kind):
    """The hooks hold the handle (and so the optimizer); once removed, nothing does."""
    model = _model(torch.float32)
    opt = mpfused.AdamW(model.parameters())
    release = mpfused.step_in_backward(opt)
    model(torch.randn(2, 24)).sum().backward()
    release.remove()
    dead = weakref.ref(opt), weakref.ref(release)
    del opt, release
    gc.collect()
    assert dead[0]() is None and dead[1]() is None
