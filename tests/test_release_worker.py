"""Gradient release's worker (issue 23, release step time on CPU): on a CPU the armed release
buckets' updates run on a thread of their own while the backward goes on
(csrc/bindings/release_worker.cpp, ``step_in_backward(..., worker_threads=)``). These tests pin
that it computes exactly the ordinary step, that it hands errors back to the backward, that an
autograd op still needing a released param fails as it does without the worker, and where it
steps aside (a Python dispatch mode, a forked child, a changed thread count)."""
import multiprocessing
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpfused
from mpfused.ops import OPS
from mpfused.optim import _release_update
from tests.test_release import CASES, _assert_identical, _loss, _model, _train

pytestmark = pytest.mark.skipif(not OPS["adam_step_"].native_available("cpu"),
                                reason="the worker runs the native kernels' armed releases")


def _native(case):
    op = {mpfused.SGD8bit: "sgd8bit_step_", mpfused.Lion8bit: "lion8bit_step_"}.get(CASES[case][0])
    if op and not OPS[op].native_available("cpu"):
        pytest.skip(f"{op} has no native CPU kernel in this build")


@pytest.mark.parametrize("case", list(CASES))
def test_release_on_the_worker_equals_ordinary_step(case):
    """Every optimizer x master mode x state kind, 50 steps with accumulation, an LR scheduler
    and a checkpoint resume: bit-identical to the ordinary step, and the worker served them."""
    _native(case)
    handles = []
    ordinary = _train(case, False, "native", 50, resume_at=25)
    released = _train(case, True, "native", 50, resume_at=25, worker_threads=1, handles=handles)
    _assert_identical(ordinary, released)
    assert len(handles) == 2 and all(h._worker[1].completed() > 0 for h in handles)


def test_two_worker_threads_equal_the_ordinary_step():
    handles = []
    case = "AdamW8bit-bf16-remainder"
    _assert_identical(_train(case, False, "native", 12),
                      _train(case, True, "native", 12, worker_threads=2, handles=handles))
    assert handles[0]._worker[0] == 2 and handles[0]._worker[1].completed() > 0


def _attached(worker_threads, bucket_bytes=600):
    model = _model(torch.bfloat16)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    release = mpfused.step_in_backward(opt, bucket_bytes=bucket_bytes,
                                       worker_threads=worker_threads)
    for _ in range(2):  # (state and armed calls exist)
        _loss(model, torch.randn(5, 24).bfloat16()).backward()
    return model, opt, release


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
def test_a_failed_release_fails_the_backward(worker_threads):
    """A state tensor shrunk in place (the armed call stands: no state epoch changes) makes the
    step op raise: in the backward's thread from the hook, on the worker at the backward's end;
    either way the backward raises the kernel's error, and the next backward after the state
    is mended works again."""
    model, opt, release = _attached(worker_threads)
    p = next(model.parameters())
    exp_avg = opt.state[p]["exp_avg"]
    kept = exp_avg.clone()
    exp_avg.resize_(3)
    with pytest.raises(RuntimeError, match=r"operands differ in size \(\[48, 24\] vs \[3\]\)"):
        _loss(model, torch.randn(5, 24).bfloat16()).backward()
    exp_avg.resize_(kept.shape).copy_(kept)
    opt.zero_grad()
    before = [q.detach().clone() for q in model.parameters()]
    _loss(model, torch.randn(5, 24).bfloat16()).backward()
    assert all(q.grad is None for q in model.parameters())
    assert all(not torch.equal(a, q) for a, q in zip(before, model.parameters()))


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
def test_a_param_needed_after_its_release_fails_autograd(worker_threads):
    """x @ w.detach() early in the forward, w used for real later: w's grad is complete (and
    w released) before the earlier op's backward, which needs w's old value. Autograd's
    version check must refuse it in both modes (the step op bumps w's version,
    csrc/bindings/op_versions.cpp; the worker bumps it at the submit, so the check does not
    race the update)."""
    torch.manual_seed(0)
    first = torch.nn.Linear(8, 8).bfloat16()
    w = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    opt = mpfused.AdamW([*first.parameters(), w], lr=1e-2)
    mpfused.step_in_backward(opt, bucket_bytes=64, worker_threads=worker_threads)

    def loss():
        h = first(torch.randn(4, 8).bfloat16())
        h = h @ w.detach()  # saves w (a view sharing its version counter)
        return (h @ w).float().square().mean()
    for step in range(3):  # (the first through _update: no state, no armed call yet)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss().backward()
        opt.zero_grad()


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_python_dispatch_mode_keeps_the_release_in_the_backward_thread():
    """The worker holds no GIL: under a TorchDispatchMode the armed release runs in place (the
    mode sees the step op) and the worker serves none."""
    model, opt, release = _attached(1)
    served = release._worker[1].completed()
    mode = _Seen()
    with mode:
        _loss(model, torch.randn(5, 24).bfloat16()).backward()
    assert release._worker[1].completed() == served
    assert any("adam_step_" in op for op in mode.ops)
    assert all(p.grad is None for p in model.parameters())


def _train_in_child(queue):
    torch.set_num_threads(1)  # as a DataLoader worker does: libgomp's parent team is gone
    model, opt, release = _CHILD
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, torch.randn(5, 24).bfloat16()).backward()
    moved = all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    queue.put((moved, release._worker[1].completed() > 0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_worker():
    """A child forked after the worker started (a fork-based DataLoader, say) cannot use the
    parent's thread: its first release starts its own (no hang)."""
    global _CHILD
    _CHILD = _attached(1)
    assert _CHILD[2]._worker[1].completed() > 0
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_train_in_child, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (True, True)


def test_worker_threads_default_and_refusals(monkeypatch):
    """Default: the CPUs torch's intra-op threads leave free, at most as many as they are."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for cpus, want in ((2, 0), (3, 1), (4, 2), (16, 2), (1, 0)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _, n=cpus: set(range(n)),
                            raising=False)
        assert _release_update.worker_threads(None) == want
    assert _release_update.worker_threads(3) == 3 and _release_update.worker_threads(0) == 0
    model = _model(torch.float32)
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="worker_threads must be None or an int >= 0"):
            mpfused.step_in_backward(mpfused.AdamW(model.parameters()), worker_threads=bad)
    with pytest.raises(RuntimeError, match="threads must be >= 1"):
        torch.classes.mpfused.ReleaseWorker(0, 2)


def test_a_changed_thread_count_makes_a_new_worker(monkeypatch):
    model, opt, release = _attached(None)
    monkeypatch.setattr(_release_update, "worker_threads", lambda requested: 1)
    _loss(model, torch.randn(5, 24).bfloat16()).backward()
    first = release._worker
    assert first[0] == 1 and first[1].completed() > 0
    monkeypatch.setattr(_release_update, "worker_threads", lambda requested: 2)
    _loss(model, torch.randn(5, 24).bfloat16()).backward()
    assert release._worker[0] == 2 and release._worker[1] is not first[1]
    monkeypatch.setattr(_release_update, "worker_threads", lambda requested: 0)
    served = release._worker[1].completed()
    _loss(model, torch.randn(5, 24).bfloat16()).backward()
    assert release._worker is None and all(p.grad is None for p in model.parameters())
    assert served > 0


def test_the_backward_thread_runs_what_the_worker_does_not_take():
    """A worker that takes no job (paused here; one that gets no CPU on a busy machine): a
    submit to a full queue runs its oldest job on the backward's thread, and the backward's end
    runs the rest; bit-identical to the ordinary step, one job at a time."""
    case = "AdamW8bit-bf16-remainder"
    handles = []
    real = _release_update.BucketUpdate._worker_on

    def paused(self, device):
        submit = real(self, device)
        if submit is not None:
            self._worker[1].pause(True)
        return submit
    _release_update.BucketUpdate._worker_on = paused
    try:
        released = _train(case, True, "native", 8, bucket_bytes=600, worker_threads=1,
                          handles=handles)
    finally:
        _release_update.BucketUpdate._worker_on = real
    _assert_identical(_train(case, False, "native", 8), released)
    worker = handles[0]._worker[1]
    assert worker.completed() == worker.stolen() > 8 * _release_update.WORKER_PENDING
