"""mpfused inside PyTorch's distributed engines (DDP, FSDP2, HSDP), on CPU with gloo and 2 processes:
each launch's results against single-process runs. The workers and the method (why the runs must
be bit-identical, CLIP_TOL) are tests/distributed_runs.py's, the model, data and snapshots
tests/distributed_model.py's, the launcher tests/distributed_harness.py's."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.distributed_harness import _launch
from tests.distributed_model import (CKPT_AT, INF_STEP, STEPS, _has_8bit, make_model, make_optim,
                                     make_scaler, params_of, state_snapshot)
from tests.distributed_runs import (ALIGNED_8BIT_PARAMS, CKPT_PARAMS, CLIP_TOL, CONFIGS,
                                    DETACHED_STEP, RELEASE_CONFIGS, UNALIGNED_8BIT, UNALIGNED_KW,
                                    UNALIGNED_TOL, train_single)


@pytest.fixture(scope="module")
def ddp_results():
    with tempfile.TemporaryDirectory() as d:
        yield _launch("ddp", d, module="tests.distributed_runs")


@pytest.fixture(scope="module")
def fsdp_results():
    with tempfile.TemporaryDirectory() as d:
        results = _launch("fsdp", d, module="tests.distributed_runs")
        results[0]["dir"] = d
        yield results




def _results(request, name, fixture=None):
    """Every rank's result of scenario `name` (fails with the worker's traceback if it raised)."""
    fixture = fixture or ("ddp_results" if CONFIGS[name][0] == "ddp" else "fsdp_results")
    if name in CONFIGS and CONFIGS[name][3] == "AdamW8bit" and not _has_8bit():
        pytest.skip("mpfused.AdamW8bit does not exist in this checkout")
    out = [res[name] for res in request.getfixturevalue(fixture)]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank}, scenario {name}:\n{r['error']}")
    return out


def _check_kinds(pname, kinds, saved_kinds):
    """After a DCP load: the saved keys, ``step`` a float32 0-d tensor, fp32 moments/masters as
    DTensors with the param's placements, 8-bit codes uint8 (and absmax fp32)."""
    assert set(kinds) == set(saved_kinds), pname
    assert kinds["step"] == ("Tensor", "torch.float32", ()), pname
    for key, kind in kinds.items():
        assert kind == saved_kinds[key], (pname, key, kind, saved_kinds[key])
        if key in ("exp_avg", "exp_avg_sq", "master"):
            assert kind[:2] in (("DTensor", "torch.float32"), ("DTensor", "torch.uint8"),
                                ("Tensor", "torch.uint8")), (pname, key, kind)
        elif "absmax" in key:
            assert kind[1] == "torch.float32", (pname, key, kind)


def _full_state(results, pname, key):
    """A state tensor of the whole param from the ranks' snapshots: DTensor state is snapshotted
    as full tensors; plain per-shard state (8-bit codes, absmax) is concatenated (dim-0 shards whose
    numel is a multiple of the block size: the blocks of the whole param)."""
    if results[0]["saved_kinds"][pname][key][0] == "DTensor" or key == "step":
        return results[0]["saved_state"][pname][key]
    return torch.cat([r["saved_state"][pname][key] for r in results])


def _reblocked(results, pname, key):
    """(codes, absmax) of 8-bit state `key` in the whole param's block layout, as a checkpoint
    holds it: the ranks' dequantized shards concatenated and quantized as one tensor."""
    import mpfused.quant_maps as qm

    qmap = qm.signed_map() if key == "exp_avg" else qm.unsigned_map()
    values = torch.cat([qm.dequantize_blockwise(r["saved_state"][pname][key],
                                                r["saved_state"][pname][key + "_absmax"], qmap,
                                                256) for r in results])
    return qm.quantize_blockwise(values, qmap, 256)


def _ckpt_results(request, name):
    if name == UNALIGNED_8BIT:
        if not _has_8bit():
            pytest.skip("mpfused.AdamW8bit does not exist in this checkout")
        return _results(request, "ckpt_" + name, "fsdp_results")
    if CONFIGS[name][3] == "AdamW8bit" and not _has_8bit():
        pytest.skip("mpfused.AdamW8bit does not exist in this checkout")
    return _results(request, "ckpt_" + name, "fsdp_results")


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(request, one_thread, name):
    results = _results(request, name)
    clip = CONFIGS[name][5]
    model, opt, _, scales = train_single(name)
    ref = params_of(model)
    for rank, res in enumerate(results):
        got = res["params"]
        assert set(got) == set(ref)
        for k in ref:
            assert got[k].dtype == ref[k].dtype
            if clip is None:  # no clipping: bit-identical (see the module docstring)
                assert torch.equal(got[k], ref[k]), f"rank {rank} {name} {k}: not bit-identical"
            else:
                torch.testing.assert_close(got[k].float(), ref[k].float(), **CLIP_TOL,
                                           msg=lambda m: f"rank {rank} {name} {k}: {m}")
        if CONFIGS[name][4]:
            assert res["scales"] == scales, f"rank {rank}: loss scale trajectory"
        # The inf in rank 1's half of INF_STEP made every rank skip that step.
        before, after = res["before_inf_step"], res["after_inf_step"]
        assert all(torch.equal(before[k], after[k]) for k in before), f"rank {rank} stepped"
    # Optimizer state (every key, 8-bit codes and absmax included) as the single run's.
    snap = state_snapshot(model, opt)
    for rank, res in enumerate(results):
        for pname, st in snap.items():
            got = res["state"][pname]
            assert set(got) == set(st), (rank, pname)
            assert float(got["step"]) == float(st["step"]) == STEPS - 1  # one skipped step
            if clip is not None:
                continue
            for key, want in st.items():
                have = got[key]
                if (CONFIGS[name][0] == "fsdp" and key != "step"
                        and res["state_kinds"][pname][key][0] != "DTensor"):
                    have = torch.cat([r["state"][pname][key] for r in results])  # per shard
                assert have.dtype == want.dtype and torch.equal(have, want), (rank, pname, key)


@pytest.mark.parametrize("name", list(RELEASE_CONFIGS))
def test_ddp_release_equals_ddp_step(request, name):
    """Gradient release under DDP: params, every state tensor and the scale trajectory are
    bit-identical to the ordinary DDP step of the same config, on every rank (the inf step is
    skipped everywhere: the averaged grads of every bucket hold it). The run detaches for one
    step and reattaches (GradRelease.reattach): release steps in every backward but that one
    (and the inf step's, which it skips)."""
    base = RELEASE_CONFIGS[name]
    released = _results(request, name, "ddp_results")
    ordinary = _results(request, base, "ddp_results")
    for rank, (rel, ref) in enumerate(zip(released, ordinary)):
        assert rel["released"] == [s not in (DETACHED_STEP, INF_STEP)
                                   for s in range(len(rel["released"]))], rank
        assert rel["scales"] == ref["scales"], rank
        for k, v in ref["params"].items():
            assert torch.equal(rel["params"][k], v), (rank, k)
        for pname, st in ref["state"].items():
            assert set(rel["state"][pname]) == set(st), (rank, pname)
            for key, v in st.items():
                assert torch.equal(rel["state"][pname][key], v), (rank, pname, key)
        before, after = rel["before_inf_step"], rel["after_inf_step"]
        assert all(torch.equal(before[k], after[k]) for k in before), rank


def test_ddp_release_without_opt_step(request):
    """A DDP release loop without opt.step() (and so without the step's reset): each backward
    is still a new one (started in its first comm hook, ended after DDP's own end of backward),
    reading the lr set since. Bit-identical to the ordinary DDP step."""
    for rank, res in enumerate(_results(request, "release_without_step", "ddp_results")):
        assert res["released"].keys() == res["ordinary"].keys()
        for k, v in res["ordinary"].items():
            assert torch.equal(res["released"][k], v), (rank, k)


def test_ddp_release_under_join(request):
    """Uneven inputs (DDP's join): the joined rank's shadow all-reduces run the release's comm
    hook outside any backward; every rank ends with the ordinary DDP step's params."""
    results = _results(request, "release_join", "ddp_results")
    for rank, res in enumerate(results):
        for k, v in results[0]["ordinary"].items():
            assert torch.equal(res["released"][k], v), (rank, k)
    # The params alone cannot tell: join() ends by broadcasting the last joiner's params. The
    # optimizer state can: with clip='previous' each shadow pass must restart its clip sums as
    # rank 0's backward does, or the ranks' moments part.
    clipped = _results(request, "release_join_clip", "ddp_results")
    for pname, st in clipped[0]["state"].items():
        for key, v in st.items():
            assert torch.equal(clipped[1]["state"][pname][key], v), (pname, key)


def test_ddp_release_refuses_a_param_ddp_does_not_reduce(request):
    """fc1.bias ignored by DDP: its grad would never reach a comm hook (never stepped)."""
    for res in _results(request, "release_refuses_unreduced", "ddp_results"):
        assert res["error_text"] is not None and "param_groups[0]['params'][1]" in res[
            "error_text"] and "not reduced in DDP's buckets" in res["error_text"]
        assert not res["attached"]


@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n][3] == "AdamW8bit"])
def test_8bit_rule_on_global_shape(request, name):
    results = _results(request, name)
    for res in results:
        kinds = res["state_kinds"]
        prefix = ""
        # fc2.weight: 4608 global elements (2304 local under FSDP2) -> 8-bit codes.
        assert kinds[prefix + "fc2.weight"]["exp_avg"][1] == "torch.uint8"
        assert kinds[prefix + "fc2.weight"]["exp_avg_absmax"][2] == (
            (9,) if CONFIGS[name][0] == "fsdp" else (18,))  # blocks of the local shard
        # 1536-element fc1.weight and the biases keep fp32 moments.
        assert kinds[prefix + "fc1.weight"]["exp_avg"][1] == "torch.float32"
        assert kinds[prefix + "fc3.bias"]["exp_avg"][1] == "torch.float32"


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "hsdp_2x1"])
def test_inf_on_one_rank_skips_everywhere(request, engine):
    """Inf written into rank 1's grad after the backward: the step is skipped on every rank
    (params bit-identical to before, step counters unchanged), the scale backs off on every rank.
    hsdp_2x1: a 2-D mesh whose shard dim has size 1, so only a reduction over the Replicate dim
    makes rank 0 see it."""
    key = "inject" if engine != "hsdp_2x1" else "inject_hsdp_2x1"
    results = _results(request, key, "ddp_results" if engine == "ddp" else "fsdp_results")
    for rank, res in enumerate(results):
        first, second = res
        assert first["changed"] and first["scale"] == 2.0**10 and first["steps"] == [1.0]
        assert second["unchanged_all"], f"rank {rank} stepped on another rank's inf"
        assert second["scale"] == 2.0**9, f"rank {rank} did not back off"
        assert second["steps"] == [1.0]


def test_clip_grad_norm_dtensor(request):
    for r in _results(request, "clip_grad_norm", "fsdp_results"):
        torch.testing.assert_close(r["norm"], r["ref_norm"], rtol=1e-6, atol=0)
        assert abs(r["norm"].item() ** 2 - r["local_norm_sq"]) > 1e-3 * r["local_norm_sq"]
        for g, rg in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(g, rg, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", CKPT_PARAMS)
def test_checkpoint_2_to_2(request, name):
    for rank, c in enumerate(_ckpt_results(request, name)):
        for pname, kinds in c["loaded_kinds"].items():
            _check_kinds(pname, kinds, c["saved_kinds"][pname])
        for pname, st in c["saved_state"].items():
            for key, v in st.items():
                assert torch.equal(c["loaded_state"][pname][key], v), (pname, key)
        for k, v in c["saved_params"].items():
            assert torch.equal(c["loaded_params"][k], v)
        assert c["loaded_scaler"] == c["saved_scaler"]
        assert c["saved_scaler"]["scale"] != 2.0**10  # backed off at INF_STEP: a real load
        for k, v in c["final_params"].items():
            assert torch.equal(c["resumed_params"][k], v), f"rank {rank} {k}: resume diverged"
        assert c["resumed_scale"] == c["final_scale"]


@pytest.mark.parametrize("name", CKPT_PARAMS)
def test_checkpoint_2_to_1(request, fsdp_results, one_thread, name):
    """The 2-rank checkpoint loaded into a plain single-process model (re-sharding), then trained
    on: same state bit for bit, fp32 state, and the same params as the 2-rank continuation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cs = _ckpt_results(request, name)
    c = cs[0]
    dtype, opt_name = CONFIGS[name][2], CONFIGS[name][3]
    model = make_model(dtype, seed=123)
    opt = make_optim(model.parameters(), opt_name, None)
    scaler = make_scaler()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        dcp.load(sd, checkpoint_id=os.path.join(fsdp_results[0]["dir"], "ckpt_" + name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])
    assert scaler.state_dict() == c["saved_scaler"]
    for k, v in params_of(model).items():
        assert torch.equal(v, c["saved_params"][k])
    loaded = state_snapshot(model, opt)
    for pname, st in c["saved_state"].items():
        assert set(loaded[pname]) == set(st), pname
        for key in st:
            want = _full_state(cs, pname, key)
            got = loaded[pname][key]
            assert got.dtype == want.dtype and got.dtype in (torch.float32, torch.uint8), (
                pname, key, got.dtype)
            assert torch.equal(got, want), (pname, key)
    train_single(name, steps=range(CKPT_AT, STEPS), model=model, opt=opt, scaler=scaler)
    for k, v in params_of(model).items():
        assert torch.equal(v, c["final_params"][k]), f"{k}: 2 -> 1 resume diverged"
    assert scaler.get_scale() == c["final_scale"]


@pytest.mark.parametrize("name", ["fsdp_8bit", UNALIGNED_8BIT])
def test_8bit_checkpoint_holds_the_unsharded_layout(request, fsdp_results, name):
    """The DCP checkpoint of a sharded AdamW8bit has the keys, dtypes and global shapes of a
    single-process AdamW8bit state_dict: codes of the param's shape, one absmax per block of the
    whole param (any number of ranks, 1 included, loads it)."""
    from torch.distributed.checkpoint import FileSystemReader

    _ckpt_results(request, name)
    meta = FileSystemReader(os.path.join(fsdp_results[0]["dir"], "ckpt_" + name)).read_metadata()
    model = make_model("float32")
    opt = make_optim(model.parameters(), "AdamW8bit", None,
                     **(UNALIGNED_KW if name == UNALIGNED_8BIT else {}))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    pids = [i for g in sd["param_groups"] for i in g["params"]]
    checked = 0
    for pid, p in zip(pids, [p for g in opt.param_groups for p in g["params"]]):
        for key, want in sd["state"][pid].items():
            if key == "step":
                continue
            got = meta.state_dict_metadata[f"optim.state.{names[id(p)]}.{key}"]
            assert tuple(got.size) == tuple(want.shape), (names[id(p)], key, got.size)
            assert got.properties.dtype == want.dtype, (names[id(p)], key)
            checked += want.dtype == torch.uint8
    assert checked == (12 if name == UNALIGNED_8BIT else 2)  # exp_avg/exp_avg_sq per 8-bit param


def test_checkpoint_8bit_unaligned_2_to_2(request):
    """Shards that are not block-aligned: the loaded state is the checkpoint's whole-param blocks
    re-quantized per local shard (exactly that), aligned params load bit-exact, and training
    resumes within quantization noise of the uninterrupted run."""
    import mpfused.quant_maps as qm

    cs = _ckpt_results(request, UNALIGNED_8BIT)
    for c in cs:
        for pname, kinds in c["loaded_kinds"].items():
            _check_kinds(pname, kinds, c["saved_kinds"][pname])
            assert kinds["exp_avg"][1] == "torch.uint8", pname  # every param 8-bit
    for rank, c in enumerate(cs):
        for pname, st in c["saved_state"].items():
            assert torch.equal(c["loaded_state"][pname]["step"], st["step"])
            rows = [r["saved_state"][pname]["exp_avg"].shape[0] for r in cs]
            lo = sum(rows[:rank])
            for key in ("exp_avg", "exp_avg_sq"):
                if pname in ALIGNED_8BIT_PARAMS:
                    want_codes, want_absmax = st[key], st[key + "_absmax"]
                else:
                    qmap = qm.signed_map() if key == "exp_avg" else qm.unsigned_map()
                    values = qm.dequantize_blockwise(*_reblocked(cs, pname, key), qmap, 256)
                    want_codes, want_absmax = qm.quantize_blockwise(
                        values[lo:lo + rows[rank]], qmap, 256)
                assert torch.equal(c["loaded_state"][pname][key], want_codes), (rank, pname, key)
                assert torch.equal(c["loaded_state"][pname][key + "_absmax"], want_absmax), (
                    rank, pname, key)
        for k, v in c["saved_params"].items():
            assert torch.equal(c["loaded_params"][k], v)
        for k, v in c["final_params"].items():
            torch.testing.assert_close(c["resumed_params"][k], v, **UNALIGNED_TOL,
                                       msg=lambda m: f"rank {rank} {k}: {m}")
        assert c["resumed_scale"] == c["final_scale"]


def test_checkpoint_8bit_unaligned_2_to_1(request, fsdp_results, one_thread):
    """The same checkpoint in one process: the unaligned params' 8-bit state is the whole-param
    quantization of the ranks' dequantized shards, the aligned ones' the ranks' codes and absmax
    concatenated (both bit for bit), then training resumes within quantization noise."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cs = _ckpt_results(request, UNALIGNED_8BIT)
    c = cs[0]
    model = make_model("float32", seed=123)
    opt = make_optim(model.parameters(), "AdamW8bit", None, **UNALIGNED_KW)
    scaler = make_scaler()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        dcp.load(sd, checkpoint_id=os.path.join(fsdp_results[0]["dir"], "ckpt_" + UNALIGNED_8BIT))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])
    for k, v in params_of(model).items():
        assert torch.equal(v, c["saved_params"][k])
    loaded = state_snapshot(model, opt)
    for pname, st in c["saved_state"].items():
        assert set(loaded[pname]) == set(st), pname
        assert torch.equal(loaded[pname]["step"], st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            if pname in ALIGNED_8BIT_PARAMS:  # the ranks' blocks are the whole param's: exact
                codes, absmax = (_full_state(cs, pname, k) for k in (key, key + "_absmax"))
            else:
                codes, absmax = _reblocked(cs, pname, key)
            assert torch.equal(loaded[pname][key], codes), (pname, key)
            assert torch.equal(loaded[pname][key + "_absmax"], absmax), (pname, key)
    train_single("fsdp_8bit", steps=range(CKPT_AT, STEPS), model=model, opt=opt, scaler=scaler)
    for k, v in params_of(model).items():
        torch.testing.assert_close(v, c["final_params"][k], **UNALIGNED_TOL,
                                   msg=lambda m: f"{k}: {m}")
    assert scaler.get_scale() == c["final_scale"]
