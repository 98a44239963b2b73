"""mpfused.AdamW8bit checkpoints: bit-identical continuation, load validation (errors before any
change), format v2 and version-1 loads, group settings and 32-bit overrides, the torch and
bitsandbytes formats (moved from tests/test_adamw8bit.py)."""
import copy
import io
import warnings

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.optim import keep_32bit_state
from tests.test_adamw8bit import _grads, _model_params


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                          (torch.bfloat16, "remainder"), (torch.bfloat16, "none")])
def test_save_load_mid_run_continues_bit_identically(dtype, master):
    mods, params = _model_params(dtype)
    keep_32bit_state(mods["emb"])
    opt = mpfused.AdamW8bit(params, lr=1e-3, master_weights=master)
    for s in range(3):
        _grads(params, s)
        opt.step()
    kinds = [opt.state[p]["exp_avg"].dtype for p in params]
    assert kinds == [torch.float32, torch.uint8, torch.float32, torch.uint8]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, map_location="cpu", weights_only=True)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    keep_32bit_state(params2[0])
    opt2 = mpfused.AdamW8bit(params2, lr=1e-3, master_weights=master)
    opt2.load_state_dict(sd)
    for p, q in zip(params, params2):
        for k, v in opt.state[p].items():
            assert opt2.state[q][k].dtype == v.dtype and torch.equal(opt2.state[q][k], v), k
    for s in range(3, 6):
        _grads(params, s)
        _grads(params2, s)
        opt.step()
        opt2.step()
    for p, q in zip(params, params2):
        assert torch.equal(p.detach().view(torch.uint8), q.detach().view(torch.uint8))
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][k], v), k


def _stepped(block_size=256, shape=(64, 100)):
    p = torch.nn.Parameter(torch.randn(shape))
    opt = mpfused.AdamW8bit([p], block_size=block_size)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


def test_load_rejects_block_size_shape_and_absmax_mismatch():
    _, opt = _stepped(256)
    sd = opt.state_dict()
    _, other = _stepped(512)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .*block_size=256.*"
                                         r"block_size=512"):
        other.load_state_dict(sd)
    sd_no_format = {k: v for k, v in sd.items() if k != "mpfused_8bit"}  # as a checkpointer
    with pytest.raises(ValueError, match="block_size=256"):           # keeping only the two
        other.load_state_dict(sd_no_format)                           # standard keys
    _, wrong_shape = _stepped(256, shape=(100, 64))
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .*shape \(64, 100\)"):
        wrong_shape.load_state_dict(sd)
    v1 = _v1(sd)
    sd["state"][0]["absmax1"] = torch.zeros(4)  # as a bnb < 0.44 (2048-block) state
    v1["state"][0]["exp_avg_absmax"] = torch.zeros(4)
    for bad in (sd, v1):
        with pytest.raises(ValueError, match=r"absmax1/exp_avg_absmax is 4 entries, but "
                                             r"ceil\(numel / block_size\) = ceil\(6400 / 256\) "
                                             r"= 25"):
            opt.load_state_dict(bad)
    sd["state"][0]["exp_avg_absmax"] = torch.zeros(25)  # both formats' keys: ambiguous
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .*both absmax1 and "
                                         r"exp_avg_absmax"):
        opt.load_state_dict(sd)


def test_torch_state_dict_round_trip():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 64))
    q = torch.nn.Parameter(p.detach().clone())
    opt8 = mpfused.AdamW8bit([p], lr=1e-2)
    for s in range(3):
        _grads([p], s)
        opt8.step()
    tsd = opt8.to_torch_state_dict()
    with torch.no_grad():
        q.copy_(p)
    topt = torch.optim.AdamW([q], lr=1e-2)
    topt.load_state_dict(tsd)  # torch accepts it and steps from it
    back = mpfused.AdamW8bit([torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    back.from_torch_state_dict(tsd)  # torch format -> quantized again
    sb, sa = back.state[back.param_groups[0]["params"][0]], opt8.state[p]
    assert sb["exp_avg"].dtype == torch.uint8 and sb["step"].item() == 3.0
    # Not bit-exact (a block whose largest |m| is negative is stored at 0.993 * absmax, so its
    # decoded absmax shrinks): decoded values agree within one top-decade code step.
    for key, akey, qmap, tol in (("exp_avg", "exp_avg_absmax", qm.signed_map(), 0.0141),
                                 ("exp_avg_sq", "exp_avg_sq_absmax", qm.unsigned_map(), 0.00704)):
        da = qm.dequantize_blockwise(sa[key], sa[akey], qmap, 256)
        db = qm.dequantize_blockwise(sb[key], sb[akey], qmap, 256)
        scale = sa[akey].repeat_interleave(256).view(da.shape)
        assert ((da - db).abs() / scale).max().item() <= tol
    _grads([p], 9)
    _grads([q], 9)
    opt8.step()
    topt.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    # Adam8bit: coupled L2 decay as torch.optim.Adam, and its state_dict loads there
    a = mpfused.Adam8bit([p], lr=1e-2, weight_decay=0.1)
    a.step()
    tadam = torch.optim.Adam([q], lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        q.copy_(p)
    tadam.load_state_dict(a.to_torch_state_dict())
    _grads([p], 10)
    _grads([q], 10)
    a.step()
    tadam.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)


# ---- checkpoint format v2, load validation, group settings, 32-bit overrides ------------------
def _v1(sd):
    """A version-1 state_dict (the codes under torch's key names) from a current one."""
    old = {"state1": "exp_avg", "state2": "exp_avg_sq", "absmax1": "exp_avg_absmax",
           "absmax2": "exp_avg_sq_absmax"}
    state = {pid: {old.get(k, k): v for k, v in s.items()} for pid, s in sd["state"].items()}
    return dict(sd, state=state, mpfused_8bit=dict(sd["mpfused_8bit"], version=1))


def _trained(dtype=torch.float32, master="fp32", steps=3):
    mods, params = _model_params(dtype)
    opt = mpfused.AdamW8bit(params, lr=1e-3, master_weights=master, min_8bit_size=6401)
    for s in range(steps):
        _grads(params, s)
        opt.step()
    return params, opt


def test_state_dict_v2_keeps_codes_out_of_torch_keys():
    params, opt = _trained(torch.bfloat16)  # emb (6400) and the bias fp32, lin.weight/big 8-bit
    sd = opt.state_dict()
    assert sd["mpfused_8bit"]["version"] == mpfused.optim.adamw8bit.FORMAT_VERSION == 2
    for key in ("exp_avg", "exp_avg_sq"):  # nothing torch.optim would cast and train on
        assert all(s[key].dtype == torch.float32 for s in sd["state"].values() if key in s)
    assert set(sd["state"][1]) == set(sd["state"][3]) == {"step", "state1", "state2", "absmax1",
                                                         "absmax2", "master"}
    assert sd["state"][1]["state1"].dtype == torch.uint8
    assert sd["state"][1]["absmax2"].dtype == torch.float32
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    # the live state keeps its keys
    assert opt.state[params[1]]["exp_avg"].dtype == torch.uint8
    assert "exp_avg_absmax" in opt.state[params[1]]
    # torch.optim.AdamW cannot silently train on the codes: it has no moments for those params
    tparams = [torch.nn.Parameter(p.detach().float()) for p in params]
    topt = torch.optim.AdamW(tparams)
    topt.load_state_dict(sd)
    _grads(tparams, 7)
    with pytest.raises(KeyError, match="exp_avg"):
        topt.step()


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "remainder")])
def test_version1_state_dict_still_loads_bit_identically(dtype, master):
    params, opt = _trained(dtype, master)
    sd = opt.state_dict()
    loaded = []
    for version_sd in (sd, _v1(sd)):
        version_sd = copy.deepcopy(version_sd)  # a load may alias same-dtype fp32 state, as torch
        params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = mpfused.AdamW8bit(params2, lr=1e-3, master_weights=master, min_8bit_size=6401)
        opt2.load_state_dict(version_sd)
        for p, q in zip(params, params2):
            assert opt2.state[q].keys() == opt.state[p].keys()
            for k, v in opt.state[p].items():
                assert opt2.state[q][k].dtype == v.dtype and torch.equal(opt2.state[q][k], v), k
        loaded.append((params2, opt2))
    for s in range(3, 5):
        for ps, o in [(params, opt)] + loaded:
            _grads(ps, s)
            o.step()
    for ps, _ in loaded:
        for p, q in zip(params, ps):
            assert torch.equal(p.detach().view(torch.uint8), q.detach().view(torch.uint8))


def test_load_rejects_amsgrad_group_before_changing_anything():
    p = torch.nn.Parameter(torch.randn(64, 100))
    topt = torch.optim.AdamW([p], amsgrad=True)
    p.grad = torch.randn_like(p)
    topt.step()
    q, opt = _stepped()
    before = {k: v.clone() for k, v in opt.state[q].items()}
    with pytest.raises(ValueError, match=r"load_state_dict: param group 0 .*amsgrad=True"):
        opt.load_state_dict(topt.state_dict())
    assert opt.param_groups[0]["amsgrad"] is False
    assert all(torch.equal(opt.state[q][k], v) for k, v in before.items())


@pytest.mark.parametrize("bad", [{"block_size": 100}, {"optim_bits": 16}, {"amsgrad": True},
                                 {"min_8bit_size": -1}], ids=lambda d: next(iter(d)))
def test_rejected_param_group_leaves_param_groups_unchanged(bad):
    p, opt = _stepped()
    extra = torch.nn.Parameter(torch.randn(8192))
    with pytest.raises(ValueError, match=f"mpfused.AdamW8bit: .*{next(iter(bad))}"):
        opt.add_param_group({"params": [extra], **bad})
    assert len(opt.param_groups) == 1
    extra.grad = torch.randn_like(extra)
    opt.step()  # the rejected group left nothing behind
    assert extra not in opt.state and opt.state[p]["step"].item() == 2.0


def test_block_size_change_requantizes_the_state():
    p, opt = _stepped(256)
    st = opt.state[p]
    before = {key: qm.dequantize_blockwise(st[key], st[akey], qmap, 256)
              for key, akey, qmap in (("exp_avg", "exp_avg_absmax", qm.signed_map()),
                                      ("exp_avg_sq", "exp_avg_sq_absmax", qm.unsigned_map()))}
    group = opt.param_groups[0]
    group["block_size"], group["lr"] = 1024, 0.0
    p.grad = torch.zeros_like(p)
    opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_absmax"].shape == (7,)
    for key, akey, qmap, beta in (("exp_avg", "exp_avg_absmax", qm.signed_map(), 0.9),
                                  ("exp_avg_sq", "exp_avg_sq_absmax", qm.unsigned_map(), 0.999)):
        after = qm.dequantize_blockwise(st[key], st[akey], qmap, 1024)
        # re-quantized, then stepped (rounded again): within two top-decade code steps
        assert st[akey].shape == (7,)
        torch.testing.assert_close(after, before[key] * beta, rtol=0,
                                   atol=2 * 0.0141 * st[akey].max().item())
    sd = opt.state_dict()
    assert sd["param_groups"][0]["block_size"] == 1024 and sd["state"][0]["absmax1"].shape == (7,)
    group["block_size"] = 100
    with pytest.raises(ValueError, match=r"mpfused.AdamW8bit: param_groups\[0\] block_size "
                                         r"must be one of"):
        opt.step()


def test_load_rejects_an_8bit_entry_with_one_float_moment():
    _, opt = _stepped()
    for key in ("state2", "state1"):
        sd = opt.state_dict()
        sd["state"][0] = dict(sd["state"][0], **{key: torch.zeros(64, 100)})
        with pytest.raises(ValueError, match=r"param 0 of param group 0 .*uint8 codes"):
            opt.load_state_dict(sd)
        assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"].dtype == torch.uint8


def test_keep_32bit_state_is_exported_and_can_be_undone():
    assert mpfused.keep_32bit_state is keep_32bit_state
    lin = torch.nn.Linear(100, 64)
    free = torch.nn.Parameter(torch.randn(8192))
    opt = mpfused.AdamW8bit([lin.weight, free])

    def kinds():
        _grads([lin.weight, free], 0)
        opt.step()
        return [opt.state[p]["exp_avg"].dtype for p in (lin.weight, free)]
    keep_32bit_state([lin, free])
    assert kinds() == [torch.float32, torch.float32]
    keep_32bit_state(lin, enabled=False)
    assert kinds() == [torch.uint8, torch.float32]
    keep_32bit_state([free], enabled=False)
    assert kinds() == [torch.uint8, torch.uint8]
    with pytest.raises(TypeError, match="keep_32bit_state takes modules or parameters"):
        keep_32bit_state([lin, 3])
    assert kinds() == [torch.uint8, torch.uint8]  # a rejected call registers nothing


def test_bitsandbytes_32bit_overrides_are_honoured():
    """bnb.nn.StableEmbedding registers {"optim_bits": 32} for its weight with bitsandbytes'
    GlobalOptimManager, as does override_config: those params keep fp32 state here too."""
    bnb = pytest.importorskip("bitsandbytes")
    mng = bnb.optim.GlobalOptimManager.get_instance()
    emb = bnb.nn.StableEmbedding(100, 64)  # 6400 elements: 8-bit by size
    overridden, plain = (torch.nn.Parameter(torch.randn(8192)) for _ in range(2))
    mng.override_config(overridden, "optim_bits", 32)
    try:
        params = [emb.weight, overridden, plain]
        opt = mpfused.AdamW8bit(params)
        _grads(params, 0)
        opt.step()
        assert [opt.state[p]["exp_avg"].dtype for p in params] == [
            torch.float32, torch.float32, torch.uint8]
        mng.override_config(plain, "optim_bits", 32)  # after the first step: converted
        _grads(params, 1)
        opt.step()
        assert opt.state[plain]["exp_avg"].dtype == torch.float32
    finally:  # the manager is process-global: leave it as found
        mng.module_weight_config_triple[:] = [t for t in mng.module_weight_config_triple
                                              if t[0] is not emb]
        for p in (overridden, plain):
            mng.pid2config.pop(id(p), None)


def test_to_bitsandbytes_state_dict_one_step_matches_bitsandbytes():
    """bitsandbytes' CPU AdamW8bit loads the export and takes one step as mpfused does, within
    the tolerances of test_one_step_matches_bitsandbytes_from_identical_state. A 512-block group
    is re-quantized to bitsandbytes' 256-element blocks; an fp32-state param exports fp32."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    shape = (512, 300)
    pa = [torch.nn.Parameter(torch.randn(shape) * 0.1), torch.nn.Parameter(torch.randn(100)),
          torch.nn.Parameter(torch.randn(64, 100) * 0.1)]
    oa = mpfused.AdamW8bit([{"params": pa[:2]}, {"params": pa[2:], "block_size": 512}],
                           lr=1e-3, weight_decay=1e-2)
    for s in range(3):
        _grads(pa, s)
        oa.step()
    sd = oa.to_bitsandbytes_state_dict()
    assert sd["state"][1]["state1"].dtype == torch.float32 and sd["state"][1]["step"] == 3
    assert sd["state"][2]["absmax1"].shape == (25,)
    for key, qmap, tol in (("exp_avg", qm.signed_map(), 0.0141), ("exp_avg_sq", qm.unsigned_map(),
                                                                    0.00704)):
        st, n = oa.state[pa[2]], 1 if key == "exp_avg" else 2
        ours = qm.dequantize_blockwise(st[key], st[key + "_absmax"], qmap, 512)
        theirs = qm.dequantize_blockwise(sd["state"][2][f"state{n}"], sd["state"][2][f"absmax{n}"],
                                         qmap, 256)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=tol * st[key + "_absmax"].max())
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ob = bnb.optim.AdamW8bit([{"params": pb[:2]}, {"params": pb[2:]}], lr=1e-3,
                             weight_decay=1e-2)
    ob.load_state_dict(sd)
    assert torch.equal(ob.state[pb[0]]["state1"], oa.state[pa[0]]["exp_avg"])
    oa.param_groups[1]["block_size"] = 256  # both sides continue from the same 2nd-group state
    oa.load_state_dict(copy.deepcopy(ob.state_dict()))  # a copy: fp32 state is not cloned
    _grads(pa, 9)
    _grads(pb, 9)
    oa.step()
    ob.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=2.4e-7, atol=3e-8)
    # absmax2: the kernels take 1 - beta2 in float32 (as torch's fused AdamW and bnb's CUDA
    # kernel), bnb's CPU path in double: 1.3e-5 relative on the g^2 term, which dominates a
    # state only 3 steps old (the identical-state test's random state is 100x larger)
    for key, bkey, akey, bakey, rtol in (
            ("exp_avg", "state1", "exp_avg_absmax", "absmax1", 3e-6),
            ("exp_avg_sq", "state2", "exp_avg_sq_absmax", "absmax2", 1.5e-5)):
        sa, sb = oa.state[pa[0]], ob.state[pb[0]]
        torch.testing.assert_close(sa[akey], sb[bakey], rtol=rtol, atol=0)
        assert (sa[key] != sb[bkey]).float().mean().item() < 5e-3
    with pytest.raises(ValueError, match="param group 0 has weight_decay=0.1 with Adam's L2"):
        mpfused.Adam8bit(pa, weight_decay=0.1).to_bitsandbytes_state_dict()


def test_version1_dcp_checkpoint_loads_through_a_version1_template(tmp_path):
    """DCP fills the template's keys: a version-1 checkpoint (codes under exp_avg) needs a
    template with those keys, which state_dict_version = 1 gives; the load converts it."""
    import torch.distributed.checkpoint as dcp

    p, opt = _stepped()
    opt.state_dict_version = 1
    saved = opt.state_dict()
    assert saved["mpfused_8bit"]["version"] == 1
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running in no_dist mode"
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))
        q = torch.nn.Parameter(torch.zeros_like(p))
        opt2 = mpfused.AdamW8bit([q])
        q.grad = torch.zeros_like(q)
        opt2.step()  # state to load into, as get_state_dict makes
        with pytest.raises(dcp.api.CheckpointException) as missing:  # v2 template keys
            dcp.load({"optim": opt2.state_dict()}, checkpoint_id=str(tmp_path))
        assert "Missing key in checkpoint state_dict: optim.state.0.state1" in repr(
            missing.value.failures)
        opt2.state_dict_version = 1
        template = {"optim": opt2.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path))
    opt2.load_state_dict(template["optim"])
    for k, v in opt.state[p].items():
        assert torch.equal(opt2.state[q][k], v), k
