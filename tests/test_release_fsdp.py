"""Gradient release under FSDP2 (``mpfused.step_in_backward(opt, fsdp=model)``) on 2 gloo ranks:
bit-identical to the ordinary FSDP2 step (params every step, every state tensor, the scale
trajectory), for fp32 AdamW, bf16 AdamW with remainder / fp32 masters, AdamW8bit, bf16 SGD with
stochastic rounding and HSDP; a NaN in one rank's shard skips that FSDP bucket on every rank
(exactly the reference's step without that bucket's grads) and backs the scale off; accumulation
over 2 micro-batches (``release.accumulate()`` and FSDP2's ``set_requires_gradient_sync``); a DCP
resume mid-run equal to the uninterrupted run; clip='previous' (FSDP2 and HSDP) against the
single-process release on the full model, the ranks bit-identical to each other. One launch:
tests/distributed_release_fsdp_runs.py (whose docstring states the NaN rule's reference)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed_release_fsdp_runs import (ACCUM, BUCKET_OF_NAN, CKPT, CLIP_BUCKET_BYTES,
                                                 CLIP_CONFIGS, CONFIGS, MAX_NORM, NAN_STEP,
                                                 STEPS, _data, make_clip_model, make_clip_optim,
                                                 results)
from tests.distributed_model import loss_fn, make_scaler
from tests.tolerances import RELEASE_FSDP_CLIP_TOL


def _results(key):
    out = [res[key] for res in results()]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank}, scenario {key}:\n{r['error']}")
    return out


def _assert_same_snapshot(got, want, where):
    assert got["scale"] == want["scale"], where
    assert set(got["params"]) == set(want["params"]), where
    for k, v in want["params"].items():
        assert got["params"][k].dtype == v.dtype and torch.equal(got["params"][k], v), (where, k)
    for pname, st in want["state"].items():
        assert set(got["state"][pname]) == set(st), (where, pname)
        for key, v in st.items():
            have = got["state"][pname][key]
            assert have.dtype == v.dtype and torch.equal(have, v), (where, pname, key)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_release_equals_fsdp_step(name):
    runs = _results(("equal", name))
    for rank, r in enumerate(runs):
        ordinary, release = r["ordinary"], r["release"]
        for step, (o, rl) in enumerate(zip(ordinary["traj"], release["traj"])):
            assert o["_scale"] == rl["_scale"], (rank, step, "loss scale")
            for k, v in o.items():
                if k != "_scale":
                    assert torch.equal(rl[k], v), f"rank {rank} step {step} {k}: not bit-identical"
        _assert_same_snapshot(release["final"], ordinary["final"], (rank, name))
        assert release["grads_left"] == [0] * STEPS, rank  # every grad freed in the backward
        # The NaN in rank 1's fc2 shard: exactly the fc2 bucket skipped, on every rank
        assert release["skipped"] == [int(s == NAN_STEP) for s in range(STEPS)], rank
        before, after = release["traj"][NAN_STEP - 1], release["traj"][NAN_STEP]
        for k in before:
            if k == "_scale":
                assert after[k] == before[k] / 2, (rank, "the scale did not back off")
            elif k in BUCKET_OF_NAN:
                assert torch.equal(after[k], before[k]), (rank, k, "stepped on a NaN")
            else:
                assert not torch.equal(after[k], before[k]), (rank, k, "did not step")
        steps = {p: float(s["step"]) for p, s in release["final"]["state"].items()}
        assert steps == {p: float(STEPS - (p in BUCKET_OF_NAN)) for p in steps}, (rank, steps)
    # and the ranks agree (state of the whole params: each rank's own step counters)
    assert runs[0]["release"]["final"]["scale"] == runs[1]["release"]["final"]["scale"]


@pytest.mark.parametrize("name", list(ACCUM))
def test_release_accumulation(name):
    """2 micro-batches a step (ACCUM[name]: release.accumulate() keeps the reduce-scattered
    sharded grads; no_sync: set_requires_gradient_sync(False), FSDP2 fires no hook until the
    synced backward): bit-identical to the ordinary step accumulating the same way."""
    for rank, r in enumerate(_results(("accum", name))):
        _assert_same_snapshot(r["release"], r["ordinary"], (rank, name, ACCUM[name]))


@pytest.mark.parametrize("name", CKPT)
def test_release_dcp_resume(name):
    """A DCP save mid-run, loaded into a fresh model + optimizer + scaler + release (DCP's
    get_state_dict makes the state with an ordinary step), continues bit-identically."""
    for rank, r in enumerate(_results(("ckpt", name))):
        _assert_same_snapshot(r["resumed"], r["uninterrupted"], (rank, name))
        if name in CLIP_CONFIGS:  # clip='previous': the carried global sums, too
            assert torch.equal(r["resumed"]["clip_sq"], r["uninterrupted"]["clip_sq"]), rank


def _clip_reference(opt_name):
    """The single-process release with clip='previous' on the full ClipNet, fed the mean of the
    two ranks' losses (FSDP2 averages their grads), the same NaN at NAN_STEP in fc2.weight: its
    buckets are FSDP2's groups (fc3, fc2, fc1), so it estimates every bucket's norm as FSDP2's
    release must. Per step: params, the carried per-param sums, skipped, scale."""
    import mpfused

    model = make_clip_model(0)
    opt = make_clip_optim(model.parameters(), opt_name)
    scaler = make_scaler()
    nan = [False]

    def inject(p):
        if nan[0]:
            p.grad[0, 0] = float("nan")
    model.fc2.weight.register_post_accumulate_grad_hook(inject)  # (fires before release's)
    release = mpfused.step_in_backward(opt, scaler=scaler, clip="previous",
                                       bucket_bytes=CLIP_BUCKET_BYTES)
    assert [c.order for c in release._chunks] == [(4, 5, 6), (2, 3), (0, 1)]  # = FSDP2's groups
    traj = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = [loss_fn(model, *_data(step, r, "float32")) for r in range(2)]
        nan[0] = step == NAN_STEP
        scaler.scale((losses[0] + losses[1]) / 2).backward()
        nan[0] = False
        skipped = int(release.skipped)
        scaler.step(opt)
        scaler.update()
        traj.append(dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                         clip_sq=release.state_dict()["clip_sq_per_param"].clone(),
                         skipped=skipped, scale=scaler.get_scale()))
    return traj


def _max_rel(got, want):
    diff = (got.double() - want.double()).abs()
    return float((diff / want.double().abs().clamp(min=1e-3)).max())


@pytest.mark.parametrize("name", list(CLIP_CONFIGS))
def test_release_clip_previous(name):
    """clip='previous' under FSDP2 (HSDP: the replicate dim is not summed): (a) each step's
    params and carried per-param sums equal the single-process release's (within
    RELEASE_FSDP_CLIP_TOL: the grads and the sums of squares differ from it only in the order
    of summation; HSDP 2x1: bit for bit), rank 1's fc3.gain shard being empty under FSDP2;
    (b) the ranks end bit-identical (the sums; HSDP replicas: params and state); (c) the NaN
    in rank 1's fc2 shard skips fc2 on every rank and counts zero."""
    runs = _results(("clip", name))
    ref = _clip_reference(CLIP_CONFIGS[name][1])
    # HSDP 2x1 (shard dim of size 1): every rank sums its full grads in the single process's
    # order, and the replicate all-reduce's average is autograd's grad of the averaged loss bit
    # for bit (a power-of-2 factor, 1 intra-op thread): exact there.
    tol = dict(rtol=0, atol=0) if CLIP_CONFIGS[name][0][-1] == 1 else RELEASE_FSDP_CLIP_TOL
    worst = {"params": 0.0, "clip_sq": 0.0}
    # fc3.gain (1 row): rank 1's shard is empty under FSDP2 (2 shards), so its fc3 bucket
    # sums its non-empty grads only and puts a zero for the empty one
    assert [r["empty_shards"] for r in runs] == (
        [[], []] if CLIP_CONFIGS[name][0][-1] == 1 else [[], ["fc3.gain"]])
    for rank, r in enumerate(runs):
        for step, (got, want) in enumerate(zip(r["traj"], ref)):
            where = (rank, name, step)
            assert got["skipped"] == want["skipped"] == int(step == NAN_STEP), where
            assert got["scale"] == want["scale"], where
            torch.testing.assert_close(got["clip_sq"], want["clip_sq"], equal_nan=False, **tol)
            worst["clip_sq"] = max(worst["clip_sq"], _max_rel(got["clip_sq"], want["clip_sq"]))
            for k, v in want["params"].items():
                torch.testing.assert_close(got["params"][k], v, equal_nan=False, **tol,
                                           msg=lambda m, k=k: f"{where} {k}: {m}")
                worst["params"] = max(worst["params"], _max_rel(got["params"][k], v))
        nan_sq = r["traj"][NAN_STEP]["clip_sq"]
        assert (nan_sq[2:4] == 0).all() and (nan_sq[[0, 1, 4, 5, 6]] > 0).all(), (rank, nan_sq)
        before, after = r["traj"][NAN_STEP - 1]["params"], r["traj"][NAN_STEP]["params"]
        for k in before:
            assert torch.equal(after[k], before[k]) == (k in BUCKET_OF_NAN), (rank, k)
        assert float(r["traj"][-1]["clip_sq"].sum()) > MAX_NORM ** 2  # it clips: it matters
    # The figures README quotes (printed with -s): the largest |got - want| / max(|want|, 1e-3)
    # over ranks, steps and elements; summation order only, so well under the tolerance's rtol.
    print(f"{name}: max relative deviation from the single process {worst}")
    assert max(worst.values()) <= tol["rtol"], worst
    a, b = (r["final"] for r in runs)
    assert torch.equal(a["clip_sq"], b["clip_sq"])
    for step in range(STEPS):
        assert torch.equal(runs[0]["traj"][step]["clip_sq"], runs[1]["traj"][step]["clip_sq"])
        for k, v in runs[0]["traj"][step]["params"].items():
            assert torch.equal(runs[1]["traj"][step]["params"][k], v), (step, k)
    if len(CLIP_CONFIGS[name][0]) == 2:  # HSDP replicas: the same local params and state
        _assert_same_snapshot(b, a, name)


def test_release_fsdp_refusals():
    for r in _results(("refusals", "")):
        kind, msg = r["no_fsdp"]
        assert kind == "NotImplementedError" and "fsdp=" in msg
        kind, msg = r["foreign_param"]
        assert kind == "ValueError" and "param_groups[0]['params'][6]" in msg
        kind, msg = r["not_fsdp_module"]
        assert kind == "TypeError" and "fully_shard" in msg
        # add_param_group refused after attaching: the old buckets and hooks still release
        kind, msg = r["add_foreign_group"]
        assert kind == "ValueError" and "param_groups[1]['params'][0]" in msg
        assert r["after_refused_add"] == dict(groups=1, grads_left=0, stepped=sorted(
            n for layer in ("fc1", "fc2", "fc3") for n in (f"{layer}.weight", f"{layer}.bias")))


# ---- single-process unit tests (no launch) ------------------------------------------------------
class _FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


def test_fsdp_clip_sums_split_by_shard_groups(monkeypatch):
    """Params of one FSDP group sharding different mesh dims (FSDP + TP: "dp" only, or "dp" and
    "tp"; a plain param: none): each part of the per-param sums is SUM-reduced over its own
    groups, every part started before the first completes, written back in place. Fake groups:
    the fake all_reduce multiplies by the group's size (as equal shards on every rank would)."""
    import torch.distributed as dist

    from mpfused.optim import _release_fsdp as rf

    size, log = {"dp": 2, "tp": 3}, []

    def all_reduce(t, op=None, group=None, async_op=False):
        assert op == dist.ReduceOp.SUM and async_op
        log.append(("reduce", group, t.tolist()))
        t.mul_(size[group])
        return _FakeWork(log, group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo")
    keys = ((0, 0), (0, 1), (1, 0), (1, 1))
    bucket = rf._FSDPBucket(keys, ("dp", "tp"),
                            {keys[0]: ("dp",), keys[1]: ("dp", "tp"), keys[2]: ("dp",),
                             keys[3]: ()})
    assert rf.split_positions([("dp",), ("dp", "tp"), ("dp",), ()]) == [
        (("dp",), [0, 2]), (("dp", "tp"), [1]), ((), [3])]
    sq = torch.tensor([1.0, 2.0, 3.0, 4.0])
    split = rf._fsdp_split(bucket, keys, sq.device)
    assert rf._fsdp_split(bucket, keys, sq.device) is split  # cached
    finish = rf._start_sum_split(sq, split)
    assert log == [("reduce", "dp", [1.0, 3.0]), ("reduce", "dp", [2.0]), ("wait", "dp"),
                   ("reduce", "tp", [4.0])]  # every part started; none completed
    assert sq.tolist() == [1.0, 2.0, 3.0, 4.0]
    finish()
    assert sq.tolist() == [2.0, 12.0, 6.0, 4.0]
    assert log[4:] == [("wait", "dp"), ("wait", "tp")]
    # one set of groups (plain FSDP): sq itself reduced, no split
    log.clear()
    sq = torch.tensor([1.0, 2.0])
    rf._start_sum_split(sq, rf._fsdp_split(bucket, keys[::2], sq.device))()
    assert sq.tolist() == [2.0, 4.0] and log == [("reduce", "dp", [1.0, 2.0]), ("wait", "dp")]


def test_fsdp_clip_partial_refused(monkeypatch):
    from mpfused.distributed import _PARTIAL
    from mpfused.optim import _release_fsdp as rf

    monkeypatch.setattr(rf, "shard_groups", lambda p: p)  # a fake param: its shard groups
    ok = [((0, 0), ("dp",)), ((0, 1), ("dp", "tp"))]
    assert rf.FSDPRelease._norm_groups(ok) == dict(ok)
    with pytest.raises(NotImplementedError,
                       match=r"param_groups\[1\]\['params'\]\[2\] has a Partial placement"):
        rf.FSDPRelease._norm_groups(ok + [((1, 2), ("dp", _PARTIAL))])
