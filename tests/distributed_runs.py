"""mpfused inside PyTorch's distributed engines, on CPU with gloo and 2 processes.

Each launch starts 2 worker processes (this module run as ``python -m tests.distributed_runs``
by tests/distributed_harness.py's ``_launch``) that run several scenarios and save their
results; the tests compare them with single-process runs done here (model, data, optimizers and
snapshots: tests/distributed_model.py).

Single-process reference ("emulated data parallel"): rank r's half of each global batch is run
separately (same shapes, 1 thread, so the forward/backward are bit-identical to the rank's) and
the grads are averaged as ``(g0 + g1) / 2``. DDP divides by the world size then sums, FSDP2
reduce-scatters with AVG; with 2 ranks all of these are the same float result (a + b is
commutative, a division by 2 is exact), so without clipping the runs must be **bit-identical**.
With clipping the global norm is a sum of per-shard sums of squares, added in another order than
the single-process pass: the clip coefficient may differ in the last bits, hence CLIP_TOL.
"""
from __future__ import annotations

import os
import sys

import torch

from tests.distributed_harness import WORLD, join_group, run_jobs
from tests.distributed_model import (CKPT_AT, INF_STEP, STEPS, _has_8bit, _wrap, batch, full,
                                     kinds_of, loss_fn, make_model, make_optim, make_scaler,
                                     params_of, state_snapshot)

# Clipping on: the global norm adds per-shard sums of squares in another order than one pass
# over the whole grads, so the clip coefficient may differ by an ulp (~6e-8 relative); Adam's
# m / sqrt(v) mostly cancels it, 8-bit requantization can round a moment to a neighbouring code.
# Measured: the fp32/bf16 runs came out bit-identical anyway, fsdp_8bit_clip 3e-8 abs / 2e-6 rel.
# A local (unreduced) norm is off by ~sqrt(2) and fails these by orders of magnitude.
CLIP_TOL = dict(rtol=1e-5, atol=1e-6)

# name: (engine, mesh shape, param dtype, optimizer, scaler?, max_grad_norm)
CONFIGS = {
    "ddp_fp32": ("ddp", (2,), "float32", "AdamW", True, None),
    "ddp_bf16_clip": ("ddp", (2,), "bfloat16", "AdamW", True, 0.05),
    "ddp_8bit": ("ddp", (2,), "float32", "AdamW8bit", True, None),
    "fsdp_fp32": ("fsdp", (2,), "float32", "AdamW", True, None),
    "fsdp_bf16": ("fsdp", (2,), "bfloat16", "AdamW", True, None),
    "fsdp_bf16_clip": ("fsdp", (2,), "bfloat16", "AdamW", True, 0.05),
    "fsdp_fp32_ownclip": ("fsdp", (2,), "float32", "AdamW", False, 0.05),
    "fsdp_8bit": ("fsdp", (2,), "float32", "AdamW8bit", True, None),
    "fsdp_8bit_clip": ("fsdp", (2,), "float32", "AdamW8bit", True, 0.05),
    "hsdp_2x1_clip": ("fsdp", (2, 1), "float32", "AdamW", True, 0.05),
    "fsdp_1x2_clip": ("fsdp", (1, 2), "float32", "AdamW", True, 0.05),
    # the other optimizer families on the same engine (issue 22)
    "ddp_sgd_bf16_clip": ("ddp", (2,), "bfloat16", "SGD", True, 0.05),
    "fsdp_sgd_fp32_clip": ("fsdp", (2,), "float32", "SGD", True, 0.05),
    "fsdp_lion_bf16": ("fsdp", (2,), "bfloat16", "Lion", True, None),
}
CKPT_CONFIGS = ["fsdp_bf16", "fsdp_8bit", "fsdp_lion_bf16"]
CKPT_PARAMS = CKPT_CONFIGS
# fsdp_8bit with every param 8-bit (min_8bit_size=0): fc3.weight (4 + 3 rows of 48 elements) and
# the biases have shards that are not block-aligned, so a checkpoint re-blocks their state into
# the whole param's blocks (and a load into the 2-rank layout re-blocks it back); fc1.weight (768
# per rank, 3 blocks) and fc2.weight (2304, 9 blocks) stay aligned: exact.
UNALIGNED_8BIT = "fsdp_8bit_unaligned"
UNALIGNED_KW = dict(min_8bit_size=0)
ALIGNED_8BIT_PARAMS = {"fc1.weight", "fc2.weight"}
# Resuming from re-blocked (requantized) state: the params follow the exact continuation within
# the 8-bit quantization noise of the moments (4 steps at lr 1e-2).
UNALIGNED_TOL = dict(rtol=0, atol=2e-3)
# Gradient release under DDP (mpfused.step_in_backward(opt, ddp=model): each bucket steps in
# DDP's communication hook once its all-reduce is done): the same run as the config named.
DETACHED_STEP = 4  # release runs detach for this step and reattach (GradRelease.reattach)
RELEASE_CONFIGS = {"ddp_release_fp32": "ddp_fp32", "ddp_release_8bit": "ddp_8bit"}
LAUNCHES = {"ddp": [n for n, c in CONFIGS.items() if c[0] == "ddp"],
            "fsdp": [n for n, c in CONFIGS.items() if c[0] == "fsdp"]}


def train_single(name, steps=range(STEPS), model=None, opt=None, scaler=None):
    """The single-process reference run of a config (emulated 2-rank data parallelism)."""
    _, _, dtype, opt_name, use_scaler, clip = CONFIGS[name]
    model = model or make_model(dtype)
    opt = opt or make_optim(model.parameters(), opt_name, clip)
    scaler = scaler or (make_scaler() if use_scaler else None)
    scales = []
    for step in steps:
        grads = []
        for rank in range(WORLD):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, *batch(step, rank, dtype))
            (scaler.scale(loss) if scaler else loss).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    return model, opt, scaler, scales


# ---- workers ----------------------------------------------------------------------------------
def _train_dist(name, rank, release=False):
    engine, mesh_shape, dtype, opt_name, use_scaler, clip = CONFIGS[name]
    model = _wrap(make_model(dtype), engine, mesh_shape)
    opt = make_optim(model.parameters(), opt_name, clip)
    scaler = make_scaler() if use_scaler else None
    if release:
        import mpfused

        handle = mpfused.step_in_backward(opt, scaler=scaler, ddp=model)
    out = {"scales": []}
    for step in range(STEPS):
        if release and step == DETACHED_STEP:  # one ordinary step: the comm hook only reduces
            handle.remove()
        if release and step == DETACHED_STEP + 1:
            handle.reattach()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, *batch(step, rank, dtype))
        first = next(model.parameters()).detach().clone()
        (scaler.scale(loss) if scaler else loss).backward()
        if release:  # release stepped in the backward: the params moved before opt.step()
            out.setdefault("released", []).append(
                not torch.equal(first, next(model.parameters())))
        if step == INF_STEP:
            out["before_inf_step"] = params_of(model)
        if scaler:
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
        if step == INF_STEP:
            out["after_inf_step"] = params_of(model)
    out["params"] = params_of(model)
    out["state"] = state_snapshot(model, opt)
    out["state_kinds"] = kinds_of(model, opt)
    return out


def _ddp_release_pair(train, modes=(False, True), clip=None):
    """``train(model, opt, release)`` on a fresh DDP model and AdamW, ordinary then released
    (``clip``: release's clip, with max_grad_norm 0.5); the params of each, the state of the
    released one."""
    import mpfused
    out = {}
    for release in modes:
        model = _wrap(make_model("float32"), "ddp", (2,))
        opt = make_optim(model.parameters(), "AdamW", clip and 0.5)
        if release:
            mpfused.step_in_backward(opt, ddp=model, clip=clip)
        train(model, opt, release)
        out["released" if release else "ordinary"] = params_of(model)
        if release:
            out["state"] = state_snapshot(model, opt)
    return out


def _release_without_step(rank):
    """DDP release in a loop that leaves out opt.step() (a no-op while released), the lr changed
    before each backward as a scheduler would: every backward starts afresh in its first comm
    hook (the lr read anew). The ordinary DDP step with opt.step() alongside, same lrs."""
    def train(model, opt, release):
        for step in range(4):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (1 + step)
            opt.zero_grad(set_to_none=True)
            loss_fn(model, *batch(step + 10, rank, "float32")).backward()
            if not release:
                opt.step()
    return _ddp_release_pair(train)


def _release_join(rank, clip=None):
    """Uneven inputs under DDP's join(): rank 1 runs out after 2 batches and then shadows rank
    0's all-reduces from DDP's join hook (twice), outside any backward, which runs the
    release's comm hook there. Release against the ordinary DDP step; with clip='previous' the
    released run alone (each shadow pass is a backward of its own: its clip sums restart)."""
    def train(model, opt, release):
        with model.join():
            for step in range(4 if rank == 0 else 2):
                opt.zero_grad(set_to_none=True)
                loss_fn(model, *batch(step + 20, rank, "float32")).backward()
                opt.step()
    return _ddp_release_pair(train, (True,) if clip else (False, True), clip)


def _release_refuses_unreduced(rank):
    """A param DDP ignores never reaches the comm hook: step_in_backward(ddp=) refuses it,
    naming it, and leaves the optimizer unattached."""
    import mpfused
    from torch.nn.parallel import DistributedDataParallel
    model = make_model("float32")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["fc1.bias"])
    ddp = DistributedDataParallel(model)
    opt = make_optim(model.parameters(), "AdamW", None)
    try:
        mpfused.step_in_backward(opt, ddp=ddp)
    except ValueError as e:
        return {"error_text": str(e), "attached": opt._grad_release is not None}
    return {"error_text": None}


def _inject_inf_one_rank(rank, engine, mesh_shape):
    """Inf written into rank 1's grad after the backward (its reduction is done): every rank must
    skip (FSDP2: via the DTensor mesh; DDP: via process_group=)."""
    import torch.distributed as dist

    import mpfused
    model = _wrap(make_model("float32"), engine, mesh_shape)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**10,
                                process_group=dist.group.WORLD if engine == "ddp" else None)
    results = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_fn(model, *batch(step + 10, rank, "float32"))).backward()
        before = params_of(model)
        if step == 1 and rank == 1:
            with torch.no_grad():
                g = model.module.fc2.weight.grad if engine == "ddp" else model.fc2.weight.grad
                (g.to_local() if hasattr(g, "to_local") else g)[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        after = params_of(model)
        results.append(dict(changed=any(not torch.equal(before[k], after[k]) for k in before),
                            unchanged_all=all(torch.equal(before[k], after[k]) for k in before),
                            scale=scaler.get_scale(),
                            steps=sorted({float(s["step"]) for s in opt.state.values()})))
    return results


def _clip_grad_norm_dtensor(rank):
    """mpfused.clip_grad_norm_ on FSDP2 DTensor grads = torch's (global norm), and clips alike."""
    import mpfused
    model = _wrap(make_model("float32"), "fsdp", (2,))
    loss_fn(model, *batch(0, rank, "float32")).backward()
    params = list(model.parameters())
    saved = [p.grad.detach().clone() for p in params]
    ref_norm = torch.nn.utils.clip_grad_norm_(params, 0.01)
    ref_grads = [full(p.grad) for p in params]
    for p, g in zip(params, saved):
        p.grad = g
    norm = mpfused.clip_grad_norm_(params, 0.01)
    return dict(norm=norm.clone(), ref_norm=full(ref_norm), grads=[full(p.grad) for p in params],
                ref_grads=ref_grads, local_norm_sq=sum(float(g.to_local().float().pow(2).sum())
                                                      for g in saved))


def _checkpoint(rank, ckpt_dir, name, **optim_kw):
    """FSDP2 run of config `name`: train, DCP-save after CKPT_AT steps, continue; then a fresh
    model/optimizer/scaler loads the checkpoint (2 -> 2) and continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dtype, opt_name = CONFIGS[name][2], CONFIGS[name][3]
    out = {}

    def run(model, opt, scaler, steps):
        for step in steps:
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_fn(model, *batch(step, rank, dtype))).backward()
            scaler.step(opt)
            scaler.update()

    model = _wrap(make_model(dtype), "fsdp", (2,))
    opt = make_optim(model.parameters(), opt_name, None, **optim_kw)
    scaler = make_scaler()
    run(model, opt, scaler, range(CKPT_AT))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, checkpoint_id=ckpt_dir)
    out["saved_state"] = state_snapshot(model, opt)
    out["saved_kinds"] = kinds_of(model, opt)
    out["saved_params"] = params_of(model)
    out["saved_scaler"] = scaler.state_dict()
    run(model, opt, scaler, range(CKPT_AT, STEPS))
    out["final_params"] = params_of(model)
    out["final_scale"] = scaler.get_scale()

    model2 = _wrap(make_model(dtype, seed=123), "fsdp", (2,))
    opt2 = make_optim(model2.parameters(), opt_name, None, **optim_kw)
    scaler2 = make_scaler()
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, "scaler": scaler2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler2.load_state_dict(sd["scaler"])
    out["loaded_state"] = state_snapshot(model2, opt2)
    out["loaded_kinds"] = kinds_of(model2, opt2)
    out["loaded_params"] = params_of(model2)
    out["loaded_scaler"] = scaler2.state_dict()
    run(model2, opt2, scaler2, range(CKPT_AT, STEPS))
    out["resumed_params"] = params_of(model2)
    out["resumed_scale"] = scaler2.get_scale()
    return out


def _worker_main(launch, rank, world, out_dir):
    join_group(rank, world, out_dir)
    jobs = {name: (lambda name=name: _train_dist(name, rank)) for name in LAUNCHES[launch]
            if CONFIGS[name][3] != "AdamW8bit" or _has_8bit()}
    jobs["inject"] = lambda: _inject_inf_one_rank(rank, launch, (2,))
    if launch == "ddp":
        jobs["release_without_step"] = lambda: _release_without_step(rank)
        jobs["release_join"] = lambda: _release_join(rank)
        jobs["release_join_clip"] = lambda: _release_join(rank, clip="previous")
        jobs["release_refuses_unreduced"] = lambda: _release_refuses_unreduced(rank)
        for name, base in RELEASE_CONFIGS.items():
            if CONFIGS[base][3] != "AdamW8bit" or _has_8bit():
                jobs[name] = lambda base=base: _train_dist(base, rank, release=True)
    if launch == "fsdp":
        jobs["inject_hsdp_2x1"] = lambda: _inject_inf_one_rank(rank, launch, (2, 1))
        jobs["clip_grad_norm"] = lambda: _clip_grad_norm_dtensor(rank)
        for name in CKPT_CONFIGS:
            if CONFIGS[name][3] != "AdamW8bit" or _has_8bit():
                jobs["ckpt_" + name] = (lambda name=name: _checkpoint(
                    rank, os.path.join(out_dir, "ckpt_" + name), name))
        if _has_8bit():
            jobs["ckpt_" + UNALIGNED_8BIT] = lambda: _checkpoint(
                rank, os.path.join(out_dir, "ckpt_" + UNALIGNED_8BIT), "fsdp_8bit", **UNALIGNED_KW)
    run_jobs(jobs, rank, out_dir)


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
