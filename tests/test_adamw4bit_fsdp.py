"""mpfused.AdamW4bit under FSDP2 with DCP checkpoints, every shard layout (2 gloo processes on CPU;
one launch, tests/distributed_4bit_runs.py, shared with tests/test_distributed_remainder8.py).

Net4's params cover every layout FSDP2 gives a 4-bit state (see tests/distributed_4bit_runs.py):
an odd element offset (a byte split across ranks), even offsets inside a block, blocks that
coincide with the whole param's while the absmax or byte chunks do not, and fully aligned shards.
The checkpoint holds the global layout of mpfused/distributed_4bit.py (the 8-bit re-blocking rule
with packed codes; the absmax of a new block is the largest absmax of the old blocks it overlaps).
Checked against an oracle written here on plain tensors (``_global_ref`` / ``_local_ref``):
* the saved global codes / absmax, and what each rank (2 -> 2) or one process (2 -> 1) loads;
* layouts whose blocks coincide (EXACT_4BIT) save and load bit for bit, so a run whose 4-bit
  params all have such layouts resumes bit-identically (2 -> 2 and 2 -> 1) and trains as one
  process bit for bit; re-blocked params resume within 4-bit noise (RESUME_TOL);
* to_torchao_state_dict / from_torchao_state_dict of DTensor params: torchao's FSDP2 layout;
* the point-to-point code mover of dim-0 shards = the all-gather one; Shard(1) params.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from mpfused import quant4 as q4
from mpfused.quant_maps import encode, inv_scale
from tests.distributed_4bit_runs import (EXACT_4BIT, LOSSY_4BIT, make, results, train_single)
from tests.distributed_harness import WORLD
from tests.distributed_model import (CKPT_AT, STEPS, kinds_of, make_scaler, params_of,
                                     state_snapshot)

BLOCK = 128
KEYS = {"exp_avg": True, "exp_avg_sq": False}  # state key: signed map
# Resuming from re-blocked 4-bit moments, 4 steps at lr 1e-2: an Adam step moves a weight by
# about lr, so the continuation stays within 4 * lr of the exact one; measured max 1.5e-2
# (d.weight; the exact-layout params move too, through the loss).
RESUME_TOL = dict(rtol=0, atol=4e-2)


def _results(name):
    res, _ = results()
    out = [r[name] for r in res]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank}, scenario {name}:\n{r['error']}")
    return out


def _split(shape, rank):
    """[e0, e1): rank's elements of a dim-0 sharded param (torch.chunk's rows)."""
    rows, inner = shape[0], int(torch.Size(shape[1:]).numel())
    size = -(-rows // WORLD)
    r0 = min(rank * size, rows)
    return r0 * inner, min(r0 + size, rows) * inner


def _qmap(key):
    return q4.signed4_map() if KEYS[key] else q4.unsigned4_map()


def _block_max(per_element, n):
    pad = -(-n // BLOCK) * BLOCK - n
    return torch.nn.functional.pad(per_element, (0, pad)).view(-1, BLOCK).amax(1)


def _global_ref(cs, pname, key, snap="saved_state"):
    """(packed codes, absmax) of the whole param that a save of the ranks' live shards gives: the
    decoded shards, each global block scaled by the largest old absmax it overlaps."""
    shape = cs[0]["saved_params"][pname].shape
    numel = shape.numel()
    values, scales = [], []
    for r, c in enumerate(cs):
        e0, e1 = _split(shape, r)
        codes = q4.unpack4(c[snap][pname][key], e1 - e0)
        scale = c[snap][pname][key + "_absmax"].repeat_interleave(BLOCK)[:e1 - e0]
        values.append(_qmap(key)[codes] * scale)
        scales.append(scale)
    values, scales = torch.cat(values), torch.cat(scales)
    gabs = _block_max(scales, numel)
    idx = torch.arange(numel) // BLOCK
    return q4.pack4(encode(values * inv_scale(gabs[idx]), _qmap(key))), gabs


def _local_ref(codes, gabs, shape, rank, key):
    """(packed codes, absmax) rank loads from the global ones: decoded with the global blocks,
    each local block scaled by the largest global absmax it overlaps."""
    e0, e1 = _split(shape, rank)
    gscale = gabs[torch.arange(e0, e1) // BLOCK]
    values = _qmap(key)[q4.unpack4(codes, shape.numel())[e0:e1]] * gscale
    labs = _block_max(gscale, e1 - e0)
    lidx = torch.arange(e1 - e0) // BLOCK
    return q4.pack4(encode(values * inv_scale(labs[lidx]), _qmap(key))), labs


def test_checkpoint_holds_the_global_layout():
    """state_dict(): packed codes of ceil(numel / 2) bytes and the whole param's absmax, equal to
    the oracle; where the blocks coincide, exactly the ranks' live codes and absmax."""
    cs = _results("fsdp4_all")
    for c in cs:
        for pname in LOSSY_4BIT | EXACT_4BIT:
            numel = c["saved_params"][pname].numel()
            for n, key in enumerate(KEYS, 1):
                assert c["global_types"][pname][f"state{n}"] == "DTensor", (pname, key)
                assert c["global_types"][pname][f"absmax{n}"] == "DTensor", (pname, key)
                got_codes = c["global"][pname][f"state{n}"]
                got_abs = c["global"][pname][f"absmax{n}"]
                assert got_codes.shape == ((numel + 1) // 2,) and got_codes.dtype == torch.uint8
                assert got_abs.shape == (-(-numel // BLOCK),), (pname, key)
                want_codes, want_abs = _global_ref(cs, pname, key)
                assert torch.equal(got_codes, want_codes), (pname, key)
                assert torch.equal(got_abs, want_abs), (pname, key)
                if pname in EXACT_4BIT:  # no re-encoding: the live codes, repacked
                    live = torch.cat([q4.unpack4(r["saved_state"][pname][key],
                                                 r["saved_state"][pname][key].numel() * 2)
                                      for r in cs])
                    assert torch.equal(got_codes, q4.pack4(live)), (pname, key)
                    assert torch.equal(got_abs, torch.cat(
                        [r["saved_state"][pname][key + "_absmax"] for r in cs])), (pname, key)


def test_dcp_checkpoint_metadata_is_the_single_process_layout():
    """The DCP files hold the keys, dtypes and global shapes of a one-process AdamW4bit."""
    from torch.distributed.checkpoint import FileSystemReader

    _, d = results()
    meta = FileSystemReader(os.path.join(d, "ckpt_fsdp4_all")).read_metadata()
    model, opt, _ = make("fsdp4_all")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    pids = [i for g in sd["param_groups"] for i in g["params"]]
    for pid, p in zip(pids, model.parameters()):
        for key, want in sd["state"][pid].items():
            got = meta.state_dict_metadata[f"optim.state.{names[id(p)]}.{key}"]
            assert tuple(got.size) == tuple(want.shape), (names[id(p)], key)
            assert got.properties.dtype == want.dtype, (names[id(p)], key)


def test_load_2_to_2_reblocks_per_local_shard():
    cs = _results("fsdp4_all")
    for rank, c in enumerate(cs):
        for pname, st in c["saved_state"].items():
            got = c["loaded_state"][pname]
            assert got.keys() == st.keys() and torch.equal(got["step"], st["step"]), pname
            shape = c["saved_params"][pname].shape
            for key in KEYS:
                codes, absmax = _local_ref(*_global_ref(cs, pname, key), shape, rank, key)
                assert torch.equal(got[key], codes), (rank, pname, key)
                assert torch.equal(got[key + "_absmax"], absmax), (rank, pname, key)
                if pname in EXACT_4BIT:
                    assert torch.equal(got[key], st[key]), (rank, pname, key)
                    assert torch.equal(got[key + "_absmax"], st[key + "_absmax"])
        for k, v in c["saved_params"].items():
            assert torch.equal(c["loaded_params"][k], v), k
        for k, v in c["final_params"].items():
            torch.testing.assert_close(c["resumed_params"][k], v, **RESUME_TOL,
                                       msg=lambda m: f"rank {rank} {k}: {m}")
        assert c["resumed_scale"] == c["final_scale"]


def test_exact_layouts_resume_and_train_bit_identically():
    """a and d kept fp32: every 4-bit param's blocks coincide with the whole param's. Load = save
    and resume = the uninterrupted run, bit for bit; training = one process, bit for bit."""
    cs = _results("fsdp4_exact")
    model, opt, scaler = train_single("fsdp4_exact")
    ref, snap = params_of(model), state_snapshot(model, opt)
    for rank, c in enumerate(cs):
        assert c["saved_kinds"]["b.weight"]["exp_avg"][1] == "torch.uint8"
        assert c["saved_kinds"]["a.weight"]["exp_avg"][:2] == ("DTensor", "torch.float32")
        for pname, st in c["saved_state"].items():
            assert c["loaded_state"][pname].keys() == st.keys(), pname
            for key, v in st.items():
                assert torch.equal(c["loaded_state"][pname][key], v), (rank, pname, key)
        for k, v in c["final_params"].items():
            assert torch.equal(c["resumed_params"][k], v), f"rank {rank} {k}: resume diverged"
            assert torch.equal(ref[k], v), f"rank {rank} {k}: not the one-process run"
        for pname, st in snap.items():
            for key, want in st.items():
                have = c["final_state"][pname][key]
                if c["final_kinds"][pname][key][0] != "DTensor" and key != "step":
                    have = torch.cat([r["final_state"][pname][key] for r in cs])  # per shard
                assert torch.equal(have, want), (rank, pname, key)
        assert c["final_scale"] == scaler.get_scale()


@pytest.mark.parametrize("name", ["fsdp4_all", "fsdp4_exact"])
def test_load_2_to_1(name):
    """The 2-rank checkpoint in one process: the global codes and absmax as they are, then
    training continues (exact layouts: bit for bit as the 2-rank continuation)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cs = _results(name)
    _, d = results()
    model, opt, _ = make(name, seed=123)
    scaler = make_scaler()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        dcp.load(sd, checkpoint_id=os.path.join(d, "ckpt_" + name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])
    loaded = state_snapshot(model, opt)
    for pname, st in cs[0]["saved_state"].items():
        assert loaded[pname].keys() == st.keys(), pname
        if cs[0]["saved_kinds"][pname]["exp_avg"][1] != "torch.uint8":
            for key, v in st.items():
                assert torch.equal(loaded[pname][key], v), (pname, key)
            continue
        for key in KEYS:
            codes, absmax = _global_ref(cs, pname, key)
            assert torch.equal(loaded[pname][key], codes), (pname, key)
            assert torch.equal(loaded[pname][key + "_absmax"], absmax), (pname, key)
    train_single(name, range(CKPT_AT, STEPS), model, opt, scaler)
    for k, v in params_of(model).items():
        if name == "fsdp4_exact":
            assert torch.equal(v, cs[0]["final_params"][k]), f"{k}: 2 -> 1 resume diverged"
        else:
            torch.testing.assert_close(v, cs[0]["final_params"][k], **RESUME_TOL)
    assert scaler.get_scale() == cs[0]["final_scale"]


@pytest.mark.parametrize("name", ["fsdp4_all", "fsdp4_exact"])
def test_load_1_to_2(name):
    """A one-process checkpoint loaded by 2 FSDP2 ranks: each rank's codes and absmax are the
    oracle's re-blocking of the whole param's (exact where the blocks coincide), then training
    continues (exact layouts: bit for bit as the uninterrupted one-process run)."""
    cs = _results("1to2_" + name)
    model, opt, scaler = train_single(name, range(CKPT_AT))
    saved, kinds = state_snapshot(model, opt), kinds_of(model, opt)
    train_single(name, range(CKPT_AT, STEPS), model, opt, scaler)
    final = params_of(model)
    for rank, c in enumerate(cs):
        for pname, st in saved.items():
            got = c["loaded_state"][pname]
            assert got.keys() == st.keys(), pname
            if kinds[pname]["exp_avg"][1] != "torch.uint8":  # fp32 state: a DTensor, exact
                for key, v in st.items():
                    assert torch.equal(got[key], v), (rank, pname, key)
                continue
            shape = c["loaded_params"][pname].shape
            for key in KEYS:
                codes, absmax = _local_ref(st[key], st[key + "_absmax"], shape, rank, key)
                assert torch.equal(got[key], codes), (rank, pname, key)
                assert torch.equal(got[key + "_absmax"], absmax), (rank, pname, key)
        for k, v in final.items():
            if name == "fsdp4_exact":
                assert torch.equal(c["resumed_params"][k], v), f"rank {rank} {k}: 1 -> 2 diverged"
            else:
                torch.testing.assert_close(c["resumed_params"][k], v, **RESUME_TOL,
                                           msg=lambda m: f"rank {rank} {k}: {m}")
        assert c["resumed_scale"] == scaler.get_scale()


def test_torchao_state_of_dtensor_params():
    """to_torchao_state_dict() of sharded params is torchao's FSDP2 state (a DTensor per param
    whose local tensor is OptimState4bit of the shard, or fp32 where torchao keeps fp32: local
    numel < 4096 or not a multiple of the block): torchao.optim.AdamW4bit over the same params
    loads it, its quantized shards hold our codes and scales byte for byte, and
    from_torchao_state_dict() brings them back byte for byte (fp32 shards re-quantized)."""
    for c in _results("fsdp4_all"):
        t = c["torchao"]
        if "skipped" in t:
            pytest.skip(t["skipped"])
        for pname, ours in t["ours"].items():
            for key in KEYS:
                theirs, back = t["torchao"][pname][key], t["back"][pname]
                codes, absmax = ours[key], ours[key + "_absmax"]
                if pname == "b.weight":  # 4224 per shard: torchao quantizes
                    assert torch.equal(theirs[0], codes) and torch.equal(theirs[1], absmax)
                    assert torch.equal(back[key], codes), (pname, key)
                    assert torch.equal(back[key + "_absmax"], absmax), (pname, key)
                    continue
                assert theirs[0] == "DTensor", (pname, key)
                n = theirs[1].numel()
                values = q4.dequantize4_blockwise(codes, absmax, _qmap(key), BLOCK, (n,))
                assert torch.equal(theirs[1].reshape(-1), values), (pname, key)
                want = q4.quantize4_blockwise(values, _qmap(key), BLOCK)
                assert torch.equal(back[key], want[0]), (pname, key)
                assert torch.equal(back[key + "_absmax"], want[1]), (pname, key)
            assert torch.equal(t["back"][pname]["step"], ours["step"])


def test_codes_move_point_to_point_as_all_gathered_and_reblocked_layouts():
    """Dim-0 shards (odd, uneven, one rank empty; FSDP2 and HSDP meshes): the point-to-point
    move of codes to byte chunks and back equals the all-gather path; Shard(1) (FSDP2's
    shard_placement_fn) and _StridedShard of dim 0 or 1 (FSDP2 + TP on one dim) params save and
    load their 4-bit and 8-bit state as the full-tensor oracle says."""
    for rank, paths in enumerate(_results("paths")):
        for layout, ok in paths.items():
            assert ok == (True, True), (rank, layout, ok)
