"""The 2-process runs behind tests/test_distributed_sgd_lion.py: configs, the single-process
reference, and the worker main (run as ``python -m tests.distributed_sgd_lion_runs all RANK
WORLD DIR``) that trains every DDP / FSDP2 scenario and takes every DCP checkpoint in one gloo
process group, saving each rank's results with ``torch.save``. Model, data, wrapping and
snapshots are tests/distributed_model.py's, the worker group tests/distributed_harness.py's."""
from __future__ import annotations

import os
import sys
import warnings

import torch

from tests.distributed_harness import WORLD, join_group, run_jobs
from tests.distributed_model import (CKPT_AT, INF_STEP, STEPS, _wrap, batch, kinds_of, loss_fn,
                                     make_model, make_scaler, params_of, state_snapshot)

# name: (engine, param dtype, optimizer, max_grad_norm)   (every run uses the GradScaler)
CONFIGS = {
    "ddp_sgd_fp32": ("ddp", "float32", "SGD", None),
    "ddp_lion_bf16": ("ddp", "bfloat16", "Lion", None),
    "ddp_sgd8bit": ("ddp", "float32", "SGD8bit", None),
    "ddp_lion8bit": ("ddp", "float32", "Lion8bit", None),
    "fsdp_sgd_bf16": ("fsdp", "bfloat16", "SGD", None),
    "fsdp_sgd8bit": ("fsdp", "float32", "SGD8bit", None),
    "fsdp_lion8bit": ("fsdp", "float32", "Lion8bit", None),
    "fsdp_sgd8bit_clip": ("fsdp", "float32", "SGD8bit", 0.05),
}
EIGHT_BIT = {"SGD8bit": "momentum_buffer", "Lion8bit": "exp_avg"}  # optimizer: its 8-bit key
# Gradient release under DDP: the same run as the config named, bit for bit.
RELEASE_CONFIGS = {"ddp_release_sgd_fp32": "ddp_sgd_fp32", "ddp_release_lion8bit": "ddp_lion8bit"}
# DCP save after CKPT_AT steps, continue; a fresh model loads it (2 -> 2 and 2 -> 1) and continues.
CKPT_CONFIGS = ["fsdp_sgd_bf16", "fsdp_sgd8bit", "fsdp_lion8bit"]
UNALIGNED = {"fsdp_sgd8bit_unaligned": "fsdp_sgd8bit", "fsdp_lion8bit_unaligned": "fsdp_lion8bit"}
UNALIGNED_KW = dict(min_8bit_size=0)


def make_optim(params, opt: str, max_grad_norm, **kw):
    import mpfused

    if opt in ("SGD", "SGD8bit"):
        return getattr(mpfused, opt)(params, lr=1e-2, momentum=0.9, weight_decay=0.1,
                                     nesterov=True, max_grad_norm=max_grad_norm, **kw)
    return getattr(mpfused, opt)(params, lr=1e-3, weight_decay=0.1, max_grad_norm=max_grad_norm,
                                 **kw)


def train_single(name, steps=range(STEPS), model=None, opt=None, scaler=None, **kw):
    """The single-process reference run of a config (emulated 2-rank data parallelism)."""
    _, dtype, opt_name, clip = CONFIGS[name]
    model = model or make_model(dtype)
    opt = opt or make_optim(model.parameters(), opt_name, clip, **kw)
    scaler = scaler or make_scaler()
    scales = []
    for step in steps:
        grads = []
        for rank in range(WORLD):
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_fn(model, *batch(step, rank, dtype))).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scaler, scales


# ---- workers ----------------------------------------------------------------------------------
def _run(model, opt, scaler, rank, dtype, steps, out=None):
    for step in steps:
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_fn(model, *batch(step, rank, dtype))).backward()
        if out is not None and step == INF_STEP:
            out["before_inf_step"] = params_of(model)
        scaler.step(opt)
        scaler.update()
        if out is not None:
            out["scales"].append(scaler.get_scale())
            if step == INF_STEP:
                out["after_inf_step"] = params_of(model)


def _train_dist(name, rank, release=False):
    engine, dtype, opt_name, clip = CONFIGS[name]
    model = _wrap(make_model(dtype), engine, (2,))
    opt = make_optim(model.parameters(), opt_name, clip)
    scaler = make_scaler()
    if release:
        import mpfused

        mpfused.step_in_backward(opt, scaler=scaler, ddp=model)
    out = {"scales": []}
    _run(model, opt, scaler, rank, dtype, range(STEPS), out)
    out.update(params=params_of(model), state=state_snapshot(model, opt),
               state_kinds=kinds_of(model, opt))
    return out


def _checkpoint(rank, ckpt_dir, name, **optim_kw):
    """As tests/distributed_runs.py's: train, DCP-save, continue; a fresh model/optimizer/scaler
    loads the checkpoint (2 -> 2) and continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, dtype, opt_name, _ = CONFIGS[name]
    model = _wrap(make_model(dtype), "fsdp", (2,))
    opt = make_optim(model.parameters(), opt_name, None, **optim_kw)
    scaler = make_scaler()
    _run(model, opt, scaler, rank, dtype, range(CKPT_AT))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, checkpoint_id=ckpt_dir)
    out = dict(saved_state=state_snapshot(model, opt), saved_kinds=kinds_of(model, opt),
               saved_params=params_of(model), saved_scaler=scaler.state_dict())
    _run(model, opt, scaler, rank, dtype, range(CKPT_AT, STEPS))
    out.update(final_params=params_of(model), final_scale=scaler.get_scale())

    model2 = _wrap(make_model(dtype, seed=123), "fsdp", (2,))
    opt2 = make_optim(model2.parameters(), opt_name, None, **optim_kw)
    scaler2 = make_scaler()
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, "scaler": scaler2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler2.load_state_dict(sd["scaler"])
    out.update(loaded_state=state_snapshot(model2, opt2), loaded_kinds=kinds_of(model2, opt2),
               loaded_params=params_of(model2), loaded_scaler=scaler2.state_dict())
    _run(model2, opt2, scaler2, rank, dtype, range(CKPT_AT, STEPS))
    out.update(resumed_params=params_of(model2), resumed_scale=scaler2.get_scale())
    return out


def _worker_main(rank, world, out_dir):
    join_group(rank, world, out_dir)
    jobs = {name: (lambda name=name: _train_dist(name, rank)) for name in CONFIGS}
    for name, base in RELEASE_CONFIGS.items():
        jobs[name] = lambda base=base: _train_dist(base, rank, release=True)
    for name in CKPT_CONFIGS:
        jobs["ckpt_" + name] = lambda name=name: _checkpoint(
            rank, os.path.join(out_dir, "ckpt_" + name), name)
    for name, base in UNALIGNED.items():
        jobs["ckpt_" + name] = lambda name=name, base=base: _checkpoint(
            rank, os.path.join(out_dir, "ckpt_" + name), base, **UNALIGNED_KW)
    run_jobs(jobs, rank, out_dir)


# ---- loading a checkpoint in one process, the checkpoint's 8-bit layout ------------------
def _load_single(ckpt_dir, name, **optim_kw):
    """The 2-rank DCP checkpoint loaded into a plain single-process model/optimizer/scaler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, dtype, opt_name, _ = CONFIGS[name]
    model = make_model(dtype, seed=123)
    opt = make_optim(model.parameters(), opt_name, None, **optim_kw)
    scaler = make_scaler()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])
    return model, opt, scaler


def _reblocked(results, pname, key):
    """(codes, absmax) of the 8-bit state `key` in the whole param's block layout, as the
    checkpoint holds it: the ranks' dequantized shards concatenated and quantized as one."""
    import mpfused.quant_maps as qm

    qmap = qm.signed_map()
    values = torch.cat([qm.dequantize_blockwise(r["saved_state"][pname][key],
                                                r["saved_state"][pname][key + "_absmax"], qmap,
                                                256) for r in results])
    return qm.quantize_blockwise(values, qmap, 256)


if __name__ == "__main__":
    _worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
