"""Gradient release under backwards of unusual shapes: a nested backward inside the one that
releases (reentrant activation checkpointing) and a backward that raises midway. The release
must tell its own backward's end from a nested graph task's and from a failed backward's."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mpfused
from tests.test_release import _assert_identical, _loss, _model, _snapshot

WORKER_MODES = dict(argvalues=[0, 1], ids=["in-backward", "worker"])


@pytest.mark.parametrize("worker_threads", **WORKER_MODES)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_equals_the_ordinary_step(reentrant, worker_threads):
    """The middle layers run under torch.utils.checkpoint. Reentrant checkpointing computes
    their grads in a backward of its own (another graph task) inside the outer one; one
    release bucket holds params on both sides of it, so the outer backward's ready params must
    survive the nested one. Bit-identical to the ordinary step."""
    snaps = []
    for release in (False, True):
        model = _model(torch.bfloat16)
        head, middle, tail = model[:2], model[2:4], model[4:]
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
        handle = (mpfused.step_in_backward(opt, bucket_bytes=1 << 20,
                                           worker_threads=worker_threads) if release else None)
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(6, 24, generator=gen).bfloat16()
            h = checkpoint(middle, head(x), use_reentrant=reentrant)
            tail(h).float().square().mean().backward()
            if release:  # the one bucket stepped inside the backward, every grad freed
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        if handle is not None:
            assert len(handle._chunks) == 1
        snaps.append(_snapshot(model, opt))
    _assert_identical(*snaps)


@pytest.mark.parametrize("worker_threads", **WORKER_MODES)
@pytest.mark.parametrize("then_step", [False, True], ids=["zero_grad", "step"])
def test_a_backward_that_raised_leaves_no_stale_release_state(then_step, worker_threads):
    """A backward raises after some params of a release bucket got their grads but before the
    bucket was complete (a tensor hook on the next param raises): its end never runs. The next
    backward must start afresh (no param counted ready from the failed one, the options read
    anew: an LR scheduler's lr); after zero_grad the training equals the ordinary step's, which
    saw the same failure. An opt.step() after the failure ("step") steps the grads there are,
    as torch.optim does: the release ends that backward there, releasing the ready params."""
    snaps = []
    for release in (False, True):
        model = _model(torch.bfloat16)
        params = list(model.parameters())
        opt = mpfused.AdamW(params, lr=1e-2)
        if release:
            mpfused.step_in_backward(opt, bucket_bytes=1 << 20, worker_threads=worker_threads)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        fail = {"on": False}

        def boom(g):
            if fail["on"]:
                raise RuntimeError("boom")
            return g
        params[0].register_hook(boom)  # the first layer's weight: the last grad of the backward
        gen = torch.Generator().manual_seed(2)
        for step in range(5):
            fail["on"] = step == 2
            x = torch.randn(6, 24, generator=gen).bfloat16()
            if fail["on"]:
                with pytest.raises(RuntimeError, match="boom"):
                    _loss(model, x).backward()
                assert any(p.grad is not None for p in params)
                if then_step:
                    opt.step()
                    if release:
                        assert all(p.grad is None for p in params)
            else:
                _loss(model, x).backward()
                opt.step()
            opt.zero_grad()
            sched.step()
        snaps.append(_snapshot(model, opt))
    _assert_identical(*snaps)


def test_compiled_autograd_is_refused_before_any_change():
    """Compiled autograd traces the post-accumulate-grad hooks into its graph; the release's
    native updates cannot be traced. The first hook refuses with a clear error, nothing
    stepped; the next eager backward releases as usual."""
    model = _model(torch.float32)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    mpfused.step_in_backward(opt, bucket_bytes=1 << 20)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    from torch._dynamo import compiled_autograd
    with pytest.raises(RuntimeError, match="not under compiled autograd"):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            _loss(model, x).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state
    opt.zero_grad()
    _loss(model, x).backward()
    assert all(p.grad is None for p in model.parameters())
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_compiled_model_equals_the_ordinary_step():
    """torch.compile on the model (aot_eager: AOT autograd's backward, eager kernels): the
    params' grad accumulation and hooks stay eager, so release steps as with an eager model.
    Bit-identical to the ordinary step of the same compiled model."""
    snaps = []
    for release in (False, True):
        model = _model(torch.bfloat16)
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
        if release:
            mpfused.step_in_backward(opt, bucket_bytes=600)
        compiled = torch.compile(model, backend="aot_eager")
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randn(6, 24, generator=gen).bfloat16()
            _loss(compiled, x).backward()
            if release:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        snaps.append(_snapshot(model, opt))
    _assert_identical(*snaps)


@pytest.mark.parametrize("worker_threads", **WORKER_MODES)
@pytest.mark.parametrize("part", ["tail", "middle"])
def test_a_reentrant_checkpoint_is_part_of_one_backward(part, worker_threads):
    """Under a reentrant checkpoint of the model's last layers ("tail") the backward's first
    grads come inside the nested backward, which would get the release's end callback: it must
    move on to the enclosing backward. One start per backward, and everything it resets
    (clip='previous' sums, release.skipped, the flags) as without checkpointing: bit-identical
    to the same release on the same model unchecked, a non-finite step included."""
    results = []
    for ckpt in (False, True):
        model = _model(torch.float32)
        opt = mpfused.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
        release = mpfused.step_in_backward(opt, bucket_bytes=600, clip="previous",
                                           worker_threads=worker_threads)
        starts, start = [], release._start_backward
        release._start_backward = lambda *a, **k: (starts.append(1), start(*a, **k))[1]
        cut = 3 if part == "tail" else 2
        head, body, rest = model[:cut], model[cut:cut + 2], model[cut + 2:]
        gen = torch.Generator().manual_seed(6)
        skipped = []
        for step in range(5):
            x = torch.randn(6, 24, generator=gen)
            if step == 2:
                x[0, 0] = float("inf")
            h = checkpoint(body, head(x), use_reentrant=True) if ckpt else body(head(x))
            rest(h).square().mean().backward()
            assert all(p.grad is None for p in model.parameters())
            skipped.append(int(release.skipped))
            opt.step()
        assert len(starts) == 5 and len(release._chunks) > 2
        results.append((_snapshot(model, opt), skipped))
    _assert_identical(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] and results[0][1][2] == len(release._chunks)


@pytest.mark.parametrize("worker_threads", **WORKER_MODES)
def test_a_training_step_inside_another_backward(worker_threads):
    """The whole training step (backward, opt.step()) runs inside another autograd node's
    backward (a custom Function's): the release's end, queued in that nested backward, would
    move on to the enclosing one, after the step. opt.step() ends it instead (the worker
    drained, a bucket with a param that got no grad released). Bit-identical to the ordinary
    step, run the same way."""
    snaps = []
    for release in (False, True):
        model = _model(torch.bfloat16)
        unused = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))  # never gets a grad
        opt = mpfused.AdamW([*model.parameters(), unused], lr=1e-2)
        if release:  # one bucket, completed only at the backward's end
            mpfused.step_in_backward(opt, bucket_bytes=1 << 20, worker_threads=worker_threads)
        gen = torch.Generator().manual_seed(7)

        class TrainInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                with torch.enable_grad():
                    for _ in range(2):
                        _loss(model, torch.randn(6, 24, generator=gen).bfloat16()).backward()
                        opt.step()
                        opt.zero_grad()
                return g

        TrainInBackward.apply(torch.ones(3, requires_grad=True)).sum().backward()
        assert all(p.grad is None for p in model.parameters())
        snaps.append(_snapshot(model, opt))
    _assert_identical(*snaps)
