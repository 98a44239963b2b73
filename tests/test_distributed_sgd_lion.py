"""SGD, Lion, SGD8bit and Lion8bit inside DDP, FSDP2 and DCP (issue 22: "as for AdamW"), on CPU
with gloo and 2 processes.

Same method as tests/test_distributed.py (whose model, data, wrapping and snapshot helpers, in
tests/distributed_model.py, this file reuses; the method: tests/distributed_runs.py's docstring): one launch of 2 worker processes
(tests/distributed_sgd_lion_runs.py) runs every DDP, FSDP2 and checkpoint scenario in one process
group, and the tests compare the results with single-process runs of the emulated
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
import tempfile

import pytest
import torch

from tests.distributed_sgd_lion_runs import (CKPT_CONFIGS, CONFIGS, EIGHT_BIT, RELEASE_CONFIGS,
                                             UNALIGNED, UNALIGNED_KW, _load_single, _reblocked,
                                             make_optim, train_single)
from tests.distributed_harness import _launch
from tests.distributed_model import CKPT_AT, STEPS, make_model, params_of, state_snapshot
from tests.distributed_runs import ALIGNED_8BIT_PARAMS, CLIP_TOL

# Resuming from re-blocked (requantized) momentum, 4 steps (the runs are deterministic; measured
# on this model). SGD8bit (lr 1e-2): the params follow the exact continuation within lr * the
# momentum's quantization noise; measured max 1.2e-4 (fc3.bias). Lion8bit (lr 1e-3): an element
# whose c = b1*m + (1-b1)*g is within the noise of 0 may take the other sign, a 2*lr = 2e-3 step;
# measured: 1 of fc1.bias' 96 elements, 2 of fc2.bias' 48, a few of fc2.weight's 4608, each by
# one flip (2e-3).
UNALIGNED_TOL = {"SGD8bit": dict(rtol=0, atol=5e-4), "Lion8bit": dict(rtol=0, atol=4 * 2e-3)}
LION_FLIPS = (4, 0.01)  # at most 4 elements + 1 % of a param may move by a flipped sign


# ---- launching and fixtures ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dist_results():
    with tempfile.TemporaryDirectory() as d:
        results = _launch("all", d, module="tests.distributed_sgd_lion_runs")
        results[0]["dir"] = d
        yield results




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
