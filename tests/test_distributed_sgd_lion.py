"""SGD, Lion, SGD8bit and Lion8bit inside DDP, FSDP2 and DCP (issue 22: "as for AdamW"), on CPU
with gloo and 2 processes.

Same method as tests/test_distributed.py (whose model, data, wrapping and snapshot helpers this
file reuses; read its docstring): one launch of 2 worker processes (this module run as
``python -m tests.test_distributed_sgd_lion``) runs every DDP, FSDP2 and checkpoint scenario in
one process group, and the tests compare the results with single-process runs of the emulated
2-rank data parallelism. Without clipping the runs must be bit-identical (params and every state
tensor, 8-bit codes and absmax included); with clipping the global norm adds per-shard sums in
another order (CLIP_TOL).

8-bit checkpoints: fc1.weight / fc2.weight shards are block-aligned (exact views); with
``min_8bit_size=0`` the biases and fc3.weight (4 + 3 rows of 48) are not, so a DCP save re-blocks
their momentum into the whole param's blocks and a load re-quantizes per local shard (the
re-blocking rules of mpfused/distributed_8bit.py, shared with AdamW8bit through State8bit).
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings

import pytest
import torch

from tests.test_distributed import (ALIGNED_8BIT_PARAMS, CKPT_AT, CLIP_TOL, INF_STEP, STEPS,
                                    UNAVAILABLE, WORLD, _wrap, batch, kinds_of, loss_fn,
                                    make_model, make_scaler, params_of, state_snapshot)
from tests.test_distributed import _launch as _launch_module

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
# Resuming from re-blocked (requantized) momentum, 4 steps (the runs are deterministic; measured
# on this model). SGD8bit (lr 1e-2): the params follow the exact continuation within lr * the
# momentum's quantization noise; measured max 1.2e-4 (fc3.bias). Lion8bit (lr 1e-3): an element
# whose c = b1*m + (1-b1)*g is within the noise of 0 may take the other sign, a 2*lr = 2e-3 step;
# measured: 1 of fc1.bias' 96 elements, 2 of fc2.bias' 48, a few of fc2.weight's 4608, each by
# one flip (2e-3).
UNALIGNED_TOL = {"SGD8bit": dict(rtol=0, atol=5e-4), "Lion8bit": dict(rtol=0, atol=4 * 2e-3)}
LION_FLIPS = (4, 0.01)  # at most 4 elements + 1 % of a param may move by a flipped sign


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
    """As tests/test_distributed.py's: train, DCP-save, continue; a fresh model/optimizer/scaler
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
    import torch.distributed as dist

    torch.set_num_threads(1)  # bit-identical forward/backward to the single-process reference
    try:
        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    except Exception as e:  # noqa: BLE001
        print(f"{UNAVAILABLE}: {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    jobs = {name: (lambda name=name: _train_dist(name, rank)) for name in CONFIGS}
    for name, base in RELEASE_CONFIGS.items():
        jobs[name] = lambda base=base: _train_dist(base, rank, release=True)
    for name in CKPT_CONFIGS:
        jobs["ckpt_" + name] = lambda name=name: _checkpoint(
            rank, os.path.join(out_dir, "ckpt_" + name), name)
    for name, base in UNALIGNED.items():
        jobs["ckpt_" + name] = lambda name=name, base=base: _checkpoint(
            rank, os.path.join(out_dir, "ckpt_" + name), base, **UNALIGNED_KW)
    results = {}
    try:
        for job, fn in jobs.items():
            try:  # one failing scenario fails its own tests only
                results[job] = fn()
            except Exception:  # noqa: BLE001
                results[job] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---- launching and fixtures ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dist_results():
    with tempfile.TemporaryDirectory() as d:
        results = _launch_module("all", d, module="tests.test_distributed_sgd_lion")
        results[0]["dir"] = d
        yield results


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _results(request, job):
    out = [res[job] for res in request.getfixturevalue("dist_results")]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank}, scenario {job}:\n{r['error']}")
    return out


def _local_state(results, key_kinds, pname, key, snap="state"):
    """A state tensor of the whole param: DTensor state is snapshotted full; plain per-shard
    state (8-bit codes and absmax) is the ranks' shards concatenated (aligned blocks)."""
    if key_kinds[pname][key][0] == "DTensor" or key == "step":
        return results[0][snap][pname][key]
    return torch.cat([r[snap][pname][key] for r in results])


# ---- tests: training --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(request, one_thread, name):
    engine, _, opt_name, clip = CONFIGS[name]
    results = _results(request, name)
    model, opt, _, scales = train_single(name)
    ref, snap = params_of(model), state_snapshot(model, opt)
    for rank, res in enumerate(results):
        assert set(res["params"]) == set(ref)
        for k, want in ref.items():
            got = res["params"][k]
            assert got.dtype == want.dtype
            if clip is None:
                assert torch.equal(got, want), f"rank {rank} {name} {k}: not bit-identical"
            else:
                torch.testing.assert_close(got.float(), want.float(), **CLIP_TOL,
                                           msg=lambda m: f"rank {rank} {name} {k}: {m}")
        assert res["scales"] == scales, f"rank {rank}: loss scale trajectory"
        before, after = res["before_inf_step"], res["after_inf_step"]
        assert all(torch.equal(before[k], after[k]) for k in before), f"rank {rank} stepped"
        for pname, st in snap.items():
            got = res["state"][pname]
            assert set(got) == set(st), (rank, pname, set(got), set(st))
            assert float(got["step"]) == float(st["step"]) == STEPS - 1  # one skipped step
            if clip is not None:
                continue
            for key, want in st.items():
                have = got[key]
                if engine == "fsdp" and key != "step":
                    have = _local_state(results, res["state_kinds"], pname, key)
                assert have.dtype == want.dtype and torch.equal(have, want), (rank, pname, key)


@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n][2] in EIGHT_BIT])
def test_8bit_rule_on_global_shape(request, name):
    """fc2.weight (4608 elements, 2304 per FSDP2 shard) gets 8-bit state, judged on the global
    shape; the 1536-element fc1.weight and the biases keep fp32 state."""
    key = EIGHT_BIT[CONFIGS[name][2]]
    for res in _results(request, name):
        kinds = res["state_kinds"]
        assert kinds["fc2.weight"][key][1] == "torch.uint8"
        assert kinds["fc2.weight"][key + "_absmax"][2] == (
            (9,) if CONFIGS[name][0] == "fsdp" else (18,))  # blocks of the local shard
        assert kinds["fc1.weight"][key][1] == "torch.float32"
        assert kinds["fc3.bias"][key][1] == "torch.float32"


@pytest.mark.parametrize("name", list(RELEASE_CONFIGS))
def test_ddp_release_equals_ddp_step(request, name):
    """mpfused.step_in_backward(opt, ddp=model) with SGD / Lion8bit: params, every state tensor
    and the scale trajectory bit-identical to the ordinary DDP step, on every rank."""
    released, ordinary = _results(request, name), _results(request, RELEASE_CONFIGS[name])
    for rank, (rel, ref) in enumerate(zip(released, ordinary)):
        assert rel["scales"] == ref["scales"], rank
        for k, v in ref["params"].items():
            assert torch.equal(rel["params"][k], v), (rank, k)
        for pname, st in ref["state"].items():
            assert set(rel["state"][pname]) == set(st), (rank, pname)
            for key, v in st.items():
                assert torch.equal(rel["state"][pname][key], v), (rank, pname, key)


# ---- tests: DCP checkpoints -------------------------------------------------------------------
def _check_kinds(pname, kinds, saved_kinds):
    """After a DCP load: the saved keys, ``step`` a float32 0-d tensor, fp32 state as DTensors
    with the param's placements, 8-bit codes uint8 and absmax fp32 (per local shard)."""
    assert set(kinds) == set(saved_kinds), pname
    assert kinds["step"] == ("Tensor", "torch.float32", ()), pname
    for key, kind in kinds.items():
        assert kind == saved_kinds[key], (pname, key, kind, saved_kinds[key])
        if key in ("momentum_buffer", "exp_avg", "master"):
            assert kind[:2] in (("DTensor", "torch.float32"), ("Tensor", "torch.uint8")), (
                pname, key, kind)
        elif key.endswith("_absmax"):
            assert kind[1] == "torch.float32", (pname, key, kind)


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


@pytest.mark.parametrize("name", CKPT_CONFIGS)
def test_checkpoint_2_to_2(request, name):
    for rank, c in enumerate(_results(request, "ckpt_" + name)):
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


@pytest.mark.parametrize("name", CKPT_CONFIGS)
def test_checkpoint_2_to_1(request, dist_results, one_thread, name):
    """A different world size: the 2-rank checkpoint in one plain process holds the same state
    bit for bit (8-bit codes and absmax of aligned shards concatenated), and training on gives
    the 2-rank continuation's params bit for bit."""
    cs = _results(request, "ckpt_" + name)
    c = cs[0]
    model, opt, scaler = _load_single(os.path.join(dist_results[0]["dir"], "ckpt_" + name), name)
    assert scaler.state_dict() == c["saved_scaler"]
    for k, v in params_of(model).items():
        assert torch.equal(v, c["saved_params"][k])
    loaded = state_snapshot(model, opt)
    for pname, st in c["saved_state"].items():
        assert set(loaded[pname]) == set(st), pname
        for key in st:
            want = _local_state(cs, c["saved_kinds"], pname, key, "saved_state")
            got = loaded[pname][key]
            assert got.dtype == want.dtype and got.dtype in (torch.float32, torch.uint8), (
                pname, key, got.dtype)
            assert torch.equal(got, want), (pname, key)
    train_single(name, steps=range(CKPT_AT, STEPS), model=model, opt=opt, scaler=scaler)
    for k, v in params_of(model).items():
        assert torch.equal(v, c["final_params"][k]), f"{k}: 2 -> 1 resume diverged"
    assert scaler.get_scale() == c["final_scale"]


def _reblocked(results, pname, key):
    """(codes, absmax) of the 8-bit state `key` in the whole param's block layout, as the
    checkpoint holds it: the ranks' dequantized shards concatenated and quantized as one."""
    import mpfused.quant_maps as qm

    qmap = qm.signed_map()
    values = torch.cat([qm.dequantize_blockwise(r["saved_state"][pname][key],
                                                r["saved_state"][pname][key + "_absmax"], qmap,
                                                256) for r in results])
    return qm.quantize_blockwise(values, qmap, 256)


def _assert_resumed_close(got, want, opt_name, where):
    tol = UNALIGNED_TOL[opt_name]
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{where}: {m}")
    if opt_name == "Lion8bit":  # a sign flip moves an element by 2*lr; few elements may flip
        moved = int(((got - want).abs() > 1e-6).sum())
        assert moved <= LION_FLIPS[0] + LION_FLIPS[1] * got.numel(), (
            f"{where}: {moved} of {got.numel()} elements took another sign")


@pytest.mark.parametrize("name", list(UNALIGNED))
def test_checkpoint_8bit_unaligned_2_to_2(request, name):
    """Shards that are not block-aligned: the loaded state is the checkpoint's whole-param blocks
    re-quantized per local shard (exactly that), aligned params load bit-exact, and training
    resumes within the quantization noise of the uninterrupted run."""
    import mpfused.quant_maps as qm

    opt_name = CONFIGS[UNALIGNED[name]][2]
    key = EIGHT_BIT[opt_name]
    cs = _results(request, "ckpt_" + name)
    for rank, c in enumerate(cs):
        for pname, kinds in c["loaded_kinds"].items():
            _check_kinds(pname, kinds, c["saved_kinds"][pname])
            assert kinds[key][1] == "torch.uint8", pname  # every param 8-bit
        for pname, st in c["saved_state"].items():
            assert torch.equal(c["loaded_state"][pname]["step"], st["step"])
            rows = [r["saved_state"][pname][key].shape[0] for r in cs]
            lo = sum(rows[:rank])
            if pname in ALIGNED_8BIT_PARAMS:
                want_codes, want_absmax = st[key], st[key + "_absmax"]
            else:
                values = qm.dequantize_blockwise(*_reblocked(cs, pname, key), qm.signed_map(),
                                                 256)
                want_codes, want_absmax = qm.quantize_blockwise(values[lo:lo + rows[rank]],
                                                                qm.signed_map(), 256)
            assert torch.equal(c["loaded_state"][pname][key], want_codes), (rank, pname)
            assert torch.equal(c["loaded_state"][pname][key + "_absmax"], want_absmax), (
                rank, pname)
        for k, v in c["saved_params"].items():
            assert torch.equal(c["loaded_params"][k], v)
        for k, v in c["final_params"].items():
            _assert_resumed_close(c["resumed_params"][k], v, opt_name, f"rank {rank} {k}")
        assert c["resumed_scale"] == c["final_scale"]


@pytest.mark.parametrize("name", list(UNALIGNED))
def test_checkpoint_8bit_unaligned_2_to_1(request, dist_results, one_thread, name):
    """The same checkpoint in one process: unaligned params' state is the whole-param
    quantization of the ranks' dequantized shards, aligned ones' the ranks' codes and absmax
    concatenated (both bit for bit); training resumes within quantization noise."""
    base = UNALIGNED[name]
    opt_name = CONFIGS[base][2]
    key = EIGHT_BIT[opt_name]
    cs = _results(request, "ckpt_" + name)
    c = cs[0]
    model, opt, scaler = _load_single(os.path.join(dist_results[0]["dir"], "ckpt_" + name), base,
                                      **UNALIGNED_KW)
    for k, v in params_of(model).items():
        assert torch.equal(v, c["saved_params"][k])
    loaded = state_snapshot(model, opt)
    for pname, st in c["saved_state"].items():
        assert set(loaded[pname]) == set(st), pname
        assert torch.equal(loaded[pname]["step"], st["step"])
        if pname in ALIGNED_8BIT_PARAMS:
            codes, absmax = (torch.cat([r["saved_state"][pname][k] for r in cs])
                             for k in (key, key + "_absmax"))
        else:
            codes, absmax = _reblocked(cs, pname, key)
        assert torch.equal(loaded[pname][key], codes), pname
        assert torch.equal(loaded[pname][key + "_absmax"], absmax), pname
    train_single(base, steps=range(CKPT_AT, STEPS), model=model, opt=opt, scaler=scaler)
    for k, v in params_of(model).items():
        _assert_resumed_close(v, c["final_params"][k], opt_name, k)
    assert scaler.get_scale() == c["final_scale"]


def test_8bit_checkpoint_holds_the_unsharded_layout(request, dist_results):
    """The DCP checkpoint of a sharded SGD8bit / Lion8bit has the keys, dtypes and global shapes
    of a single-process state_dict (codes of the param's shape as ``state1``, one absmax per
    block of the whole param as ``absmax1``), so any number of ranks loads it."""
    from torch.distributed.checkpoint import FileSystemReader

    for name, base in UNALIGNED.items():
        _results(request, "ckpt_" + name)
        meta = FileSystemReader(os.path.join(dist_results[0]["dir"], "ckpt_" + name)
                                ).read_metadata()
        model = make_model("float32")
        opt = make_optim(model.parameters(), CONFIGS[base][2], None, **UNALIGNED_KW)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        sd = opt.state_dict()
        pids = [i for g in sd["param_groups"] for i in g["params"]]
        checked = 0
        for pid, p in zip(pids, [p for g in opt.param_groups for p in g["params"]]):
            assert set(sd["state"][pid]) == {"step", "state1", "absmax1"}, names[id(p)]
            for key, want in sd["state"][pid].items():
                got = meta.state_dict_metadata[f"optim.state.{names[id(p)]}.{key}"]
                assert tuple(got.size) == tuple(want.shape), (names[id(p)], key, got.size)
                assert got.properties.dtype == want.dtype, (names[id(p)], key)
                checked += want.dtype == torch.uint8
        assert checked == 6, name  # one 8-bit state per param


if __name__ == "__main__":
    _worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
