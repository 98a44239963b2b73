"""The 2-process runs behind tests/test_adamw4bit_fsdp.py and tests/test_distributed_remainder8.py
(one launch for both: ``results()`` runs it once per pytest process). The worker main (``python
-m tests.distributed_4bit_runs all RANK WORLD DIR``) trains every FSDP2 scenario and takes every
DCP checkpoint in one gloo process group, saving each rank's results with ``torch.save``. Data,
wrapping and snapshots are tests/distributed_model.py's, the launcher and worker group
tests/distributed_harness.py's, the single-process method tests/distributed_runs.py's.

Net4: every layout FSDP2 gives a 4-bit state on 2 ranks (block 128; rows split as torch.chunk):
  a.weight (33, 17)  rows 17 | 16 -> 289 | 272 elements: odd offset, a byte split across ranks
  a.bias   (33,)     17 | 16: odd offset
  b.weight (256, 33) 4224 | 4224: block- and byte-aligned (views; torchao quantizes the shards)
  c.weight (7, 256)  1024 | 768: blocks coincide, the absmax chunks (7 | 7) and bytes do not
  d.weight (128, 7)  448 | 448 and d.bias (128,) 64 | 64: even offsets inside a block
  e.weight (7, 128)  512 | 384: blocks and absmax chunks coincide, byte chunks (224 | 224) do not
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile

import torch

from tests.distributed_harness import WORLD, _launch, join_group, run_jobs
from tests.distributed_model import (CKPT_AT, STEPS, _wrap, batch, kinds_of, loss_fn, make_model,
                                     make_scaler, params_of, state_snapshot)

BATCH = 4
LOSSY_4BIT = {"a.weight", "a.bias", "d.weight", "d.bias"}  # re-blocked: not bit-exact
EXACT_4BIT = {"b.weight", "c.weight", "e.weight"}
# name: (model, param dtype, optimizer, optimizer kwargs)     (every run uses the GradScaler)
CONFIGS = {
    "fsdp4_all": ("net4", "float32", "AdamW4bit", dict(min_8bit_size=0)),
    "fsdp4_exact": ("net4", "float32", "AdamW4bit", dict(min_8bit_size=0)),  # a, d kept fp32
    "r8_adamw": ("net", "bfloat16", "AdamW", dict(master_weights="remainder8")),
    "r8_adamw8bit": ("net", "bfloat16", "AdamW8bit", dict(master_weights="remainder8")),
    "r8_adamw4bit": ("net", "bfloat16", "AdamW4bit", dict(master_weights="remainder8")),
}


class Net4(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(17, 33)
        self.b = torch.nn.Linear(33, 256, bias=False)
        self.c = torch.nn.Linear(256, 7, bias=False)
        self.d = torch.nn.Linear(7, 128)
        self.e = torch.nn.Linear(128, 7, bias=False)

    def forward(self, x):
        for layer in (self.a, self.b, self.c, self.d):
            x = torch.tanh(layer(x))
        return self.e(x)


def _batch4(step, rank):
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(WORLD * BATCH, 17, generator=g), torch.randn(WORLD * BATCH, 7, generator=g)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[sl], y[sl]


def make(name, seed=0, rank=None):
    """(model, optimizer, batch function) of a config; sharded over 2 ranks when rank is given."""
    import mpfused

    kind, dtype, opt_name, kw = CONFIGS[name]
    if kind == "net4":
        torch.manual_seed(seed)
        model = Net4()
        if rank is not None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in (model.a, model.b, model.c, model.d, model.e):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    else:
        model = make_model(dtype, seed)
        if rank is not None:
            model = _wrap(model, "fsdp", (WORLD,))
    if name == "fsdp4_exact":
        mpfused.keep_32bit_state([model.a, model.d])
    opt = getattr(mpfused, opt_name)(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    return model, opt, _data(name)


def run(model, opt, scaler, data, steps, rank=None):
    """Train on `steps`: rank r's half batch, or (rank None) the emulated 2-rank average."""
    for step in steps:
        grads = []
        for r in ([rank] if rank is not None else range(WORLD)):
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_fn(model, *data(step, r))).backward()
            grads.append([p.grad for p in model.parameters()])
        if rank is None:
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = (g0 + g1) / 2
        scaler.step(opt)
        scaler.update()


def train_single(name, steps=range(STEPS), model=None, opt=None, scaler=None):
    """The single-process reference run of a config (emulated 2-rank data parallelism), at one
    intra-op thread as the ranks (distributed_harness): CPU matmuls may round differently at
    another thread count (seen on an AMD EPYC VM: the exact-layout runs then differed from the
    ranks' in the last bits with the test process at 2 threads)."""
    if model is None:
        model, opt, _ = make(name)
    scaler = scaler or make_scaler()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(model, opt, scaler, _data(name), steps)
    finally:
        torch.set_num_threads(threads)
    return model, opt, scaler


def _data(name):
    kind, dtype = CONFIGS[name][:2]
    return _batch4 if kind == "net4" else functools.partial(batch, dtype=dtype)


def _checkpoint(rank, ckpt_dir, name):
    """Train CKPT_AT steps, DCP-save, continue to STEPS; a fresh model and optimizer load the
    checkpoint (2 -> 2) and continue."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    model, opt, data = make(name, rank=rank)
    scaler = make_scaler()
    run(model, opt, scaler, data, range(CKPT_AT), rank)
    msd, osd = get_state_dict(model, opt)
    out["global_types"] = {k: {n: type(v).__name__ for n, v in st.items()}
                           for k, st in osd["state"].items()}
    out["global"] = {k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                         for n, v in st.items()} for k, st in osd["state"].items()}
    dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, checkpoint_id=ckpt_dir)
    out["saved_state"], out["saved_kinds"] = state_snapshot(model, opt), kinds_of(model, opt)
    out["saved_params"] = params_of(model)
    run(model, opt, scaler, data, range(CKPT_AT, STEPS), rank)
    out["final_params"], out["final_state"] = params_of(model), state_snapshot(model, opt)
    out["final_kinds"] = kinds_of(model, opt)
    out["final_scale"] = scaler.get_scale()

    model2, opt2, _ = make(name, seed=123, rank=rank)
    scaler2 = make_scaler()
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, "scaler": scaler2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler2.load_state_dict(sd["scaler"])
    out["loaded_state"], out["loaded_kinds"] = state_snapshot(model2, opt2), kinds_of(model2, opt2)
    out["loaded_params"] = params_of(model2)
    run(model2, opt2, scaler2, data, range(CKPT_AT, STEPS), rank)
    out["resumed_params"], out["resumed_scale"] = params_of(model2), scaler2.get_scale()
    if name == "fsdp4_all":
        out["torchao"] = _torchao_round_trip(model2, opt2)
    return out


def _load_1_to_2(rank, ckpt_dir, name):
    """A one-process DCP checkpoint (rank 0 trains alone and saves with no_dist) loaded into the
    2-rank FSDP2 model, which continues training."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if rank == 0:
        model, opt, scaler = train_single(name, range(CKPT_AT))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()},
                 checkpoint_id=ckpt_dir, no_dist=True)
    dist.barrier()
    model, opt, data = make(name, seed=123, rank=rank)
    scaler = make_scaler()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])
    out = {"loaded_state": state_snapshot(model, opt), "loaded_kinds": kinds_of(model, opt),
           "loaded_params": params_of(model)}
    run(model, opt, scaler, data, range(CKPT_AT, STEPS), rank)
    out["resumed_params"], out["resumed_scale"] = params_of(model), scaler.get_scale()
    return out


def _torchao_round_trip(model, opt):
    """to_torchao_state_dict() of a sharded AdamW4bit, loaded into torchao's AdamW4bit over the
    same FSDP2 params, and back into a fresh mpfused.AdamW4bit."""
    try:
        import torchao.optim
    except ImportError:
        return {"skipped": "torchao is not installed"}
    import mpfused
    from torchao.optim.subclass_4bit import OptimState4bit

    sd = opt.to_torchao_state_dict()
    ao = torchao.optim.AdamW4bit(model.parameters(), lr=1e-2, weight_decay=0.1)
    ao.load_state_dict(sd)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"ours": {}, "torchao": {}, "back": {}}
    for p in model.parameters():
        n = names[id(p)]
        out["ours"][n] = {k: v.clone() for k, v in opt.state[p].items()}
        ao_st = {}
        for k, v in ao.state[p].items():
            lv = v.to_local() if hasattr(v, "to_local") else v
            ao_st[k] = ((lv.codes.clone(), lv.scale.clone()) if isinstance(lv, OptimState4bit)
                        else (type(v).__name__, lv.detach().clone()))
        out["torchao"][n] = ao_st
    back = mpfused.AdamW4bit(model.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    back.from_torchao_state_dict(ao.state_dict())
    out["back"] = {names[id(p)]: {k: v.clone() for k, v in back.state[p].items()}
                   for p in model.parameters()}
    return out


def _layout_paths(rank):
    """mpfused/distributed_4bit.py's code movers outside training: the point-to-point path of
    dim-0 shards = the all-gather path, both directions, for odd, uneven and empty shards; a
    Shard(1) param (the all-gather path) saved and loaded, checked against full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from mpfused import distributed_4bit as d4

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(7)  # the same draws on every rank
    out = {}
    for shape in [(33, 17), (33,), (7, 256), (128, 7), (7, 128), (3, 5), (1, 9), (0, 4)]:
        p = distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)])
        mine = torch.Generator().manual_seed(100 * rank + len(out))
        elems = torch.randint(0, 16, (p.to_local().numel(),), generator=mine, dtype=torch.uint8)
        nbytes = (p.numel() + 1) // 2
        gbytes = distribute_tensor(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8),
                                   mesh, [Shard(0)])
        out[shape] = (torch.equal(d4._codes_to_bytes(p, elems), d4._gather_to_bytes(p, elems)),
                      torch.equal(d4._bytes_to_codes(p, gbytes), d4._gather_from_bytes(p, gbytes)))

    hsdp = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    for shape in [(33, 17), (7, 128)]:  # HSDP: the shard group is the mesh's second dim
        p = distribute_tensor(torch.randn(shape, generator=g), hsdp, [Replicate(), Shard(0)])
        elems = torch.randint(0, 16, (p.to_local().numel(),), generator=g, dtype=torch.uint8)
        gbytes = distribute_tensor(torch.randint(0, 256, ((p.numel() + 1) // 2,), generator=g,
                                                 dtype=torch.uint8), hsdp, [Replicate(), Shard(0)])
        out[("hsdp",) + shape] = (
            torch.equal(d4._codes_to_bytes(p, elems), d4._gather_to_bytes(p, elems)),
            torch.equal(d4._bytes_to_codes(p, gbytes), d4._gather_from_bytes(p, gbytes)))

    layouts = {"shard1": [Shard(1)], "strided0": [_StridedShard(0, split_factor=2)],
               "strided1": [_StridedShard(1, split_factor=2)]}
    for name, pls in layouts.items():
        out[name + "_4bit"] = _reblock_4bit(mesh, pls, rank, g)
        out[name + "_8bit"] = _reblock_8bit(mesh, pls, rank, g)
    return out


def _placed(mesh, pls, shape, g):
    """(param, full(local) -> flat whole tensor, mine(whole) -> flat local tensor) of a param
    of `shape` placed with `pls` on `mesh` (the full-tensor oracle's two directions)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    p = distribute_tensor(torch.randn(shape, generator=g), mesh, pls, src_data_rank=None)
    local = p.to_local()

    def full(t):
        return DTensor.from_local(t.view(local.shape), mesh, pls, run_check=False,
                                  shape=p.shape, stride=p.stride()).full_tensor().reshape(-1)

    def mine(t):
        return DTensor.from_local(t.view(shape), mesh, [Replicate()], run_check=False).redistribute(
            mesh, pls).to_local().reshape(-1)
    return p, full, mine


def _block_max(x, m, block):
    return torch.nn.functional.pad(x, (0, -(-m // block) * block - m)).view(-1, block).amax(1)


def _reblock_4bit(mesh, pls, rank, g):
    """A re-blocked 4-bit save and load (placements whose local blocks are not the whole
    param's: Shard(1), FSDP2 + TP's _StridedShard) against the full-tensor oracle."""
    from mpfused import distributed_4bit as d4
    from mpfused import quant4 as q4
    from mpfused.quant_maps import encode, inv_scale

    shape, qmap, block = (6, 301), q4.signed4_map(), 128
    p, full, mine_of = _placed(mesh, pls, shape, g)
    local = p.to_local()
    n = local.numel()
    codes, absmax = q4.quantize4_blockwise(local * (rank + 1), qmap, block)
    gcodes, gabs = d4.to_global4(p, codes, absmax, qmap, block)
    scale = absmax.repeat_interleave(block)[:n]
    values, scales = full(qmap[q4.unpack4(codes, n)] * scale), full(scale)
    want_abs = _block_max(scales, p.numel(), block)
    per_elem = want_abs[torch.arange(p.numel()) // block]
    want_codes = encode(values * inv_scale(per_elem), qmap)
    save = torch.equal(gcodes.full_tensor(), q4.pack4(want_codes)) and torch.equal(
        gabs.full_tensor(), want_abs)
    lcodes, labs = d4.from_global4(p, gcodes, gabs, qmap, block)
    gscale = mine_of(per_elem)
    want_labs = _block_max(gscale, n, block)
    want_l = encode(qmap[mine_of(want_codes)] * gscale
                    * inv_scale(want_labs[torch.arange(n) // block]), qmap)
    return save, torch.equal(lcodes, q4.pack4(want_l)) and torch.equal(labs, want_labs)


def _reblock_8bit(mesh, pls, rank, g):
    """The same for the 8-bit state (mpfused/distributed_8bit.py: the global absmax of a block
    is the largest |value| it holds; a load re-quantizes per local block)."""
    from mpfused import distributed_8bit as d8
    from mpfused.quant_maps import quantize_blockwise, signed_map

    shape, qmap, block = (6, 301), signed_map(), 256
    p, full, mine_of = _placed(mesh, pls, shape, g)
    local = p.to_local()
    codes, absmax = quantize_blockwise(local * (rank + 1), qmap, block)
    gcodes, gabs = d8._to_global(p, codes, absmax, qmap, block)
    values = qmap[codes.long().reshape(-1)] * absmax.repeat_interleave(block)[:local.numel()]
    whole = full(values)
    want_abs = _block_max(whole.abs(), p.numel(), block)
    per_elem = want_abs[torch.arange(p.numel()) // block]
    want_codes = d8._encode_scaled(whole, per_elem, qmap)
    save = torch.equal(gcodes.full_tensor().reshape(-1), want_codes) and torch.equal(
        gabs.full_tensor(), want_abs)
    lcodes, labs = d8._from_global(p, gcodes, gabs, qmap, block)
    want_l = quantize_blockwise(qmap[mine_of(want_codes).long()] * mine_of(per_elem), qmap, block)
    return save, torch.equal(lcodes.reshape(-1), want_l[0].reshape(-1)) and torch.equal(
        labs, want_l[1])


def _worker_main(launch, rank, world, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    join_group(rank, world, out_dir)
    jobs = {name: functools.partial(_checkpoint, rank, os.path.join(out_dir, "ckpt_" + name), name)
            for name in CONFIGS}
    jobs.update({"1to2_" + name: functools.partial(
        _load_1_to_2, rank, os.path.join(out_dir, "ckpt1_" + name), name)
        for name in ("fsdp4_all", "fsdp4_exact")})
    jobs["paths"] = functools.partial(_layout_paths, rank)
    run_jobs(jobs, rank, out_dir)


_DIR = None


@functools.cache
def results():
    """Every rank's results (launched once per pytest process; the directory lives as long)."""
    global _DIR
    _DIR = tempfile.TemporaryDirectory(prefix="mpfused-dist4-")
    res = _launch("all", _DIR.name, module="tests.distributed_4bit_runs")
    return res, _DIR.name


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
