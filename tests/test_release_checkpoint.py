"""A torch.distributed.checkpoint (DCP) checkpoint taken in the middle of a gradient-release run
(mpfused.step_in_backward, issue 23) resumes exactly: a fresh model, optimizer, scheduler and
release handle load it and continue bit-identically to the run that was never interrupted.
Single process (DCP's no-dist mode), as a one-rank job saves and loads."""
import warnings

import pytest
import torch

import mpfused
from tests.test_release import CASES, _assert_identical, _loss, _model, _snapshot

STEPS, SAVE_AT, MAX_NORM = 10, 4, 0.02


def _build(case, seed):
    """Model, optimizer (max_grad_norm: clip='previous' carries the previous norm across the
    checkpoint), scheduler and the release handle, attached before anything is loaded (as a
    training script does it)."""
    cls, dtype, kwargs = CASES[case]
    model = _model(dtype, seed=seed)
    opt = cls(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    release = mpfused.step_in_backward(opt, clip="previous", bucket_bytes=2048)
    return model, opt, sched, release


def _train(run, steps, dtype):
    model, opt, sched, release = run
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)  # the same batches whenever it resumes
        with release.accumulate():
            _loss(model, torch.randn(6, 24, generator=gen).to(dtype)).backward()
        _loss(model, torch.randn(6, 24, generator=gen).to(dtype)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _resume(case, ckpt, with_release_state=True):
    """A fresh run (other initial weights) loads the checkpoint through get_state_dict /
    dcp.load / set_state_dict, as torch's docs do it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run = _build(case, seed=1)
    model, opt, sched, release = run
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "sched": sched.state_dict()}
    if with_release_state:
        sd["release"] = release  # Stateful: DCP calls its state_dict / load_state_dict
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched.load_state_dict(sd["sched"])
    return run


@pytest.mark.parametrize("case", ["AdamW-bf16-master", "AdamW8bit-bf16-remainder"])
def test_dcp_checkpoint_mid_release_run_resumes_bit_identically(case, tmp_path):
    """Saved after SAVE_AT of STEPS steps (2-micro-batch accumulation, StepLR, clip='previous'),
    loaded into a fresh run whose release handle was attached before the load, continued to
    STEPS: params, masters / remainders, moments, 8-bit codes and step counts equal the
    uninterrupted run's bit for bit. Two controls show the test can fail: without the handle's
    state (the previous step's per-param sums of squares) the resumed run differs, and the
    optimizer state really was loaded (DCP's get_state_dict makes the state to load into with a
    step() on zero grads, which release must not swallow)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dtype = CASES[case][1]
    whole = _build(case, seed=0)
    _train(whole, range(STEPS), dtype)

    run = _build(case, seed=0)
    _train(run, range(SAVE_AT), dtype)
    ckpt = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        msd, osd = get_state_dict(run[0], run[1])
        dcp.save({"model": msd, "optim": osd, "sched": run[2].state_dict(), "release": run[3]},
                 checkpoint_id=ckpt)
        saved = _snapshot(run[0], run[1])
        resumed = _resume(case, ckpt)
        no_norm = _resume(case, ckpt, with_release_state=False)
    _assert_identical(_snapshot(resumed[0], resumed[1]), saved)  # the whole state was loaded
    assert torch.equal(resumed[3].state_dict()["clip_sq_per_param"],
                       run[3].state_dict()["clip_sq_per_param"])
    assert run[3].state_dict()["clip_sq_per_param"].sum() > MAX_NORM ** 2  # it clips: it matters

    _train(resumed, range(SAVE_AT, STEPS), dtype)
    _train(no_norm, range(SAVE_AT, STEPS), dtype)
    _assert_identical(_snapshot(resumed[0], resumed[1]), _snapshot(whole[0], whole[1]))
    assert not all(torch.equal(a, b) for a, b in zip(_snapshot(no_norm[0], no_norm[1]),
                                                     _snapshot(whole[0], whole[1])))
