"""Gradient release's one-call bucket update (issue 23): ``BoundLists.released_<op>`` checks the
release bucket's grads, records the flags and steps in one native call; it computes exactly
what the two-op path does (check op, flags, step op: ``ops/bound.py``'s ``check_and_record``),
skips the whole release bucket (every planner bucket it splits into) on a non-finite grad and
records the flag for the scaler. Also: a param group added after attaching is released too."""
import copy

import pytest
import torch

import mpfused
from mpfused.ops import OPS
from mpfused.ops import adam as adam_ops
from mpfused.ops.bound import BoundOp, check_and_record
from tests.test_release import _finish_step

NATIVE = OPS["adam_step_"].native_available("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="needs the native CPU kernels")


def _has_released() -> bool:
    if not NATIVE:
        return False
    b = BoundOp(adam_ops.adam_step_, [[torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [],
                                      [], [torch.zeros(())]])
    return b.native() is not None and b._released


needs_released = pytest.mark.skipif(not _has_released(),
                                    reason="the extension predates BoundLists.released_*")


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 40), torch.nn.GELU(),
                               torch.nn.Linear(40, 6)).to(dtype)


def _snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state.get(p, {})
        out += [st[k].clone() for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    return out


CASES = {
    "AdamW-fp16-scaler": (mpfused.AdamW, torch.float16, {}, True),
    "AdamW8bit-bf16-remainder": (mpfused.AdamW8bit, torch.bfloat16,
                                 {"min_8bit_size": 512, "master_weights": "remainder"}, False),
    "SGD-bf16": (mpfused.SGD, torch.bfloat16, {"momentum": 0.9}, False),
    "Lion8bit-bf16": (mpfused.Lion8bit, torch.bfloat16, {"min_8bit_size": 512}, False),
}


def _run(case, fused: bool, monkeypatch, steps=10, bucket_bytes=4000):
    """Train with release, NaN/inf injected into some grads on some steps; return the final
    snapshot and, per step, (skipped, the backward's found flag, the scale)."""
    cls, dtype, kwargs, with_scaler = CASES[case]
    with monkeypatch.context() as m:
        if not fused:  # the two-op path: no native lists, so BoundOp calls the op itself
            m.setattr(BoundOp, "native", lambda self: None)
        model = _model(dtype)
        opt = cls(model.parameters(), lr=1e-2, **kwargs)
        scaler = mpfused.GradScaler("cpu", init_scale=2.0**6, growth_interval=2) \
            if with_scaler else None
        release = mpfused.step_in_backward(opt, scaler=scaler, bucket_bytes=bucket_bytes)
        params = list(model.parameters())
        bad = {2: {0}, 5: {3, 4}, 7: {1}}  # step -> params whose grad gets a NaN/inf
        now = {"step": 0}

        def make(i):
            def hook(g):
                if i in bad.get(now["step"], ()):
                    g = g.clone()
                    g.view(-1)[-1] = float("nan") if i % 2 else float("-inf")
                return g
            return hook
        for i, p in enumerate(params):
            p.register_hook(make(i))
        gen = torch.Generator().manual_seed(4)
        record = []
        for step in range(steps):
            now["step"] = step
            loss = model(torch.randn(5, 24, generator=gen).to(dtype)).float().square().mean()
            (scaler.scale(loss) if scaler else loss).backward()
            found = {d: float(f) for d, f in release.found_inf_per_device().items()}
            record.append((int(release.skipped), found))
            _finish_step(opt, scaler, record)
        n_chunks = len(release._chunks)
        release.remove()
    return _snapshot(model, opt), record, n_chunks


@needs_released
@pytest.mark.parametrize("case", list(CASES))
def test_fused_path_equals_two_op_path(case, monkeypatch):
    """The one native call per release bucket gives the two-op path's params, state, skip counts,
    found flags and scale, bit for bit, with non-finite grads on some steps."""
    fused, rec_fused, n = _run(case, True, monkeypatch)
    plain, rec_plain, _ = _run(case, False, monkeypatch)
    assert n == 3  # one of them holds an 8-bit and an fp32-state param (two planner buckets)
    assert rec_fused == rec_plain
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    skipped = [r[0] for r in rec_fused if isinstance(r, tuple)]
    assert skipped[0] == 0 and skipped[2] >= 1 and skipped[5] >= 1  # the injected steps
    assert all(list(r[1].values()) == [1.0 if r[0] else 0.0]
               for r in rec_fused if isinstance(r, tuple))


@needs_released
def test_released_call_equals_check_then_step():
    """BoundLists.released_adam_step_ against check_and_record + the plain call, directly: the
    flags (bucket, total, skipped) and the updated tensors, with and without a non-finite grad,
    and the totals carried over from an earlier bucket."""
    torch.manual_seed(0)
    shapes = [(7, 3), (130,), (1,)]
    init = [torch.randn(s) for s in shapes]

    def bucket():
        params = [x.clone() for x in init]
        lists = [params, [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes], [],
                 [], [torch.zeros(()) for _ in shapes]]
        return BoundOp(adam_ops.adam_step_, lists), lists
    grads = [torch.randn(s) for s in shapes]
    other = [torch.randn(5)]  # a grad of another planner bucket of the same release bucket
    inv = torch.tensor(0.5)
    for poison in (None, "grad", "other"):
        g, o = [x.clone() for x in grads], [x.clone() for x in other]
        if poison == "grad":
            g[1][17] = float("inf")
        elif poison == "other":
            o[0][2] = float("nan")
        results = []
        for fused in (True, False):
            b, lists = bucket()
            found = torch.tensor(1.0)  # stale from an earlier bucket: cleared by the call
            total, skipped = torch.tensor(0.0), torch.tensor(3, dtype=torch.int32)
            kw = dict(lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.01, amsgrad=False, maximize=False, decoupled=True,
                      master_mode=0, grad_scale=torch.tensor(2.0), found_inf=found, norm_sq=None,
                      max_grad_norm=0.0, seed=0)
            if fused:
                b.check_first(g + o, found, inv, total, skipped)
                b(g, **kw)
                assert b._pre is None
            else:
                check_and_record(g + o, found, inv, total, skipped)
                b.op(lists[0], g, *lists[1:], **kw)
            results.append((float(found), float(total), int(skipped),
                            [t.clone() for ts in lists for t in ts]))
        (f1, t1, s1, x1), (f2, t2, s2, x2) = results
        assert (f1, t1, s1) == (f2, t2, s2) == ((0.0, 0.0, 3) if poison is None
                                                else (1.0, 1.0, 4))
        assert all(torch.equal(a, b) for a, b in zip(x1, x2))
        if poison:  # skipped: the params did not move
            b, lists = bucket()
            assert all(torch.equal(a, b) for a, b in zip(x1, [t for ts in lists for t in ts]))


@needs_native
def test_release_uses_one_native_call_per_planner_bucket(monkeypatch):
    """No separate check op on the native path: check_grads is never called from Python, and
    every release bucket's first planner bucket goes through released_<op>."""
    import mpfused.ops.bound
    import mpfused.optim._release_update
    if not _has_released():
        pytest.skip("the extension predates BoundLists.released_*")
    calls = []
    for module in (mpfused.ops.bound, mpfused.optim._release_update):  # the Python check, if taken
        monkeypatch.setattr(module, "check_and_record", lambda *a, **k: calls.append("check"))
    model = _model(torch.bfloat16)
    opt = mpfused.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=512)
    release = mpfused.step_in_backward(opt, bucket_bytes=4000)
    seen = []
    orig = BoundOp.check_first

    def spy(self, *a):
        seen.append(self.op.name)
        return orig(self, *a)
    monkeypatch.setattr(BoundOp, "check_first", spy)
    model(torch.randn(4, 24).bfloat16()).float().sum().backward()
    opt.step()
    assert calls == []
    assert len(seen) == len(release._chunks) == 3


def _train_with_added_group(release: bool, cls, kwargs, clip=None, steps=8, add_at=3):
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 32).bfloat16()
    head = torch.nn.Linear(32, 6).bfloat16()
    extra = {"max_grad_norm": 0.5} if clip else {}
    opt = cls(base.parameters(), lr=1e-2, **kwargs, **extra)
    handle = mpfused.step_in_backward(opt, bucket_bytes=600, clip=clip) if release else None
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == add_at:
            opt.add_param_group({"params": list(head.parameters()), "lr": 3e-2})
        x = torch.randn(6, 24, generator=gen).bfloat16()
        head(base(x)).float().square().mean().backward()
        stepped = [p for g in opt.param_groups for p in g["params"]]
        if release:
            assert all(p.grad is None for p in stepped)
        opt.step()
        opt.zero_grad()
        head.zero_grad()  # (before it is added: grads no optimizer takes)
    return [p.detach().clone() for p in [*base.parameters(), *head.parameters()]], opt, handle


@pytest.mark.parametrize("cls,kwargs", [(mpfused.AdamW, {}),
                                        (mpfused.AdamW8bit, {"min_8bit_size": 64})],
                         ids=["AdamW", "AdamW8bit"])
def test_add_param_group_after_attaching(cls, kwargs):
    """A group added mid-training after step_in_backward: its params get release buckets and
    hooks, and the run equals the ordinary one bit for bit (the new params untouched before)."""
    ordinary, _, _ = _train_with_added_group(False, cls, kwargs)
    released, opt, handle = _train_with_added_group(True, cls, kwargs)
    for a, b in zip(ordinary, released):
        assert torch.equal(a, b)
    assert {c.group_index for c in handle._chunks} == {0, 1}
    handle.remove()


def test_add_param_group_after_attaching_with_clip():
    """clip='previous': the new params enter the per-param sums (zero previous sums) and the
    handle's state_dict has one entry per param."""
    _, opt, handle = _train_with_added_group(True, mpfused.AdamW, {}, clip="previous")
    n = sum(len(g["params"]) for g in opt.param_groups)
    sq = handle.state_dict()["clip_sq_per_param"]
    assert sq.shape == (n,) and bool((sq > 0).all())


def test_add_param_group_refused_leaves_nothing():
    """A group the optimizer refuses gets no release hooks (and is not added)."""
    model = _model(torch.float32)
    opt = mpfused.AdamW8bit(model.parameters())
    handle = mpfused.step_in_backward(opt)
    n_hooks, n_chunks = len(handle._handles), len(handle._chunks)
    with pytest.raises(ValueError, match="block_size"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8))], "block_size": 3})
    assert len(opt.param_groups) == 1
    assert (len(handle._handles), len(handle._chunks)) == (n_hooks, n_chunks)
    copy.deepcopy(opt)  # still a plain optimizer to copy
