"""Gradient release under FSDP2 (``mpfused.step_in_backward(opt, fsdp=model)``) on 2 gloo ranks:
bit-identical to the ordinary FSDP2 step (params every step, every state tensor, the scale
trajectory), for fp32 AdamW, bf16 AdamW with remainder / fp32 masters, AdamW8bit, bf16 SGD with
stochastic rounding and HSDP; a NaN in one rank's shard skips that FSDP bucket on every rank
(exactly the reference's step without that bucket's grads) and backs the scale off; accumulation
over 2 micro-batches (``release.accumulate()`` and FSDP2's ``set_requires_gradient_sync``); a DCP
resume mid-run equal to the uninterrupted run. One launch: tests/distributed_release_fsdp_runs.py
(whose docstring states the NaN rule's reference)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed_release_fsdp_runs import (ACCUM, BUCKET_OF_NAN, CKPT, CONFIGS, NAN_STEP,
                                                 STEPS, results)


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


def test_release_fsdp_refusals():
    for r in _results(("refusals", "")):
        kind, msg = r["clip"]
        assert kind == "NotImplementedError" and "clip='previous'" in msg and "FSDP2" in msg
        kind, msg = r["no_fsdp"]
        assert kind == "NotImplementedError" and "fsdp=" in msg
        kind, msg = r["foreign_param"]
        assert kind == "ValueError" and "param_groups[0]['params'][6]" in msg
        kind, msg = r["not_fsdp_module"]
        assert kind == "TypeError" and "fully_shard" in msg
