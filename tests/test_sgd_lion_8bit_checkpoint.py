"""SGD8bit / Lion8bit checkpoints: save/load continues bit for bit, bitsandbytes loads the export
and continues, exports bitsandbytes would not apply are refused, torch cross-loads, foreign and
version-1 checkpoints (moved from tests/test_sgd_lion_8bit.py, whose helpers these use)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from tests.test_sgd_lion_8bit import (BACKENDS, CASES, MASTER_CASES, MASTER_IDS, TOP_STEP,
                                     _assert_near_bnb, _backend, _bnb_class, _clone, _decoded,
                                     _params, _set_grads, _state_equal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,master", MASTER_CASES, ids=MASTER_IDS)
@pytest.mark.parametrize("name", CASES)
def test_save_load_continue_bit_exact(name, dtype, master, backend):
    case = CASES[name]
    pa = _params(dtype)
    oa = case["cls"](pa, master_weights=master, backend=_backend(backend), **case["kw"])
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _set_grads(gen, pa)
        oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "state1" in saved["state"][0] and case["key"] not in saved["state"][0]
    pb = _clone(pa)
    ob = case["cls"](pb, master_weights=master, backend=_backend(backend), **case["kw"])
    ob.load_state_dict(saved)
    for _ in range(3):
        _set_grads(gen, pa, pb)
        oa.step()
        ob.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        _state_equal(oa.state[a], ob.state[b])
    assert oa.state[pa[0]][case["key"]].dtype == torch.uint8
    assert oa.state[pa[2]][case["key"]].dtype == torch.float32


@pytest.mark.parametrize("name", CASES)
def test_bitsandbytes_loads_the_export_and_continues(name):
    """to_bitsandbytes_state_dict() loads into bitsandbytes and both continue as from identical
    state; a 512-element-block group is re-quantized to bitsandbytes' 256 (decoded within one
    top-decade step) and an fp32-state param exports fp32."""
    case = CASES[name]
    pa = _params()
    oa = case["cls"]([{"params": pa[:1], "block_size": 512}, {"params": pa[1:]}],
                     backend="reference", **case["kw"])
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        _set_grads(gen, pa)
        oa.step()
    sd = oa.to_bitsandbytes_state_dict()
    assert sd["state"][2]["state1"].dtype == torch.float32 and sd["state"][2]["step"] == 3
    assert sd["state"][0]["absmax1"].shape == (25,) and sd["state"][1]["absmax1"].shape == (20,)
    st = oa.state[pa[0]]
    scale = st[case["key"] + "_absmax"].max()
    torch.testing.assert_close(_decoded(sd["state"][0]["state1"], sd["state"][0]["absmax1"]),
                               _decoded(st[case["key"]], st[case["key"] + "_absmax"], 512),
                               rtol=0, atol=TOP_STEP * scale.item())
    pb = _clone(pa)
    ob = _bnb_class(name)([{"params": pb[:1]}, {"params": pb[1:]}], **case["kw"])
    ob.load_state_dict(sd)
    assert torch.equal(ob.state[pb[1]]["state1"], oa.state[pa[1]][case["key"]])
    oa.param_groups[0]["block_size"] = 256  # both continue from the exported state
    oa.load_state_dict(copy.deepcopy(ob.state_dict()))
    _set_grads(gen, pa, pb)
    oa.step()
    ob.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=2.4e-7, atol=1e-7)
    for i in (0, 1):
        _assert_near_bnb(oa.state[pa[i]], ob.state[pb[i]], case["key"])


@pytest.mark.parametrize("bad", [dict(dampening=0.1), dict(nesterov=True), dict(maximize=True)],
                         ids=lambda d: next(iter(d)))
def test_sgd8bit_export_refuses_what_bitsandbytes_would_not_apply(bad):
    opt = mpfused.SGD8bit(_params(), lr=0.01, momentum=0.9, **bad)
    with pytest.raises(ValueError, match=f"param group 0 has {next(iter(bad))}"):
        opt.to_bitsandbytes_state_dict()


@pytest.mark.parametrize("name", CASES)
def test_torch_cross_load(name):
    """to_torch_state_dict() loads into the fp32 optimizer (torch.optim.SGD; mpfused.Lion: torch
    has no Lion) and both continue alike; the fp32 optimizer's state_dict loads (quantized to
    the nearest codes, as quantize_blockwise)."""
    case = CASES[name]
    pa = _params()
    oa = case["cls"](pa, backend="reference", **case["kw"])
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        _set_grads(gen, pa)
        oa.step()
    pt = _clone(pa)
    ot = case["fp32"](pt, **case["kw"])
    ot.load_state_dict(oa.to_torch_state_dict())
    st = ot.state[pt[0]][case["key"]]
    assert st.dtype == torch.float32 and "master" not in ot.state[pt[0]]
    sa = oa.state[pa[0]]
    assert torch.equal(st, _decoded(sa[case["key"]], sa[case["key"] + "_absmax"]))
    _set_grads(gen, pa, pt)
    oa.step()
    ot.step()
    for a, t in zip(pa, pt):
        torch.testing.assert_close(a, t, rtol=2.4e-7, atol=1e-7)
    back = case["cls"](_clone(pt), backend="reference", **case["kw"])
    back.load_state_dict(ot.state_dict())
    sb = back.state[back.param_groups[0]["params"][0]]
    codes, absmax = qm.quantize_blockwise(ot.state[pt[0]][case["key"]], qm.signed_map(), 256)
    assert torch.equal(sb[case["key"]], codes.view(sb[case["key"]].shape))
    assert torch.equal(sb[case["key"] + "_absmax"], absmax)
    # torch.optim.SGD keeps the exported counter but never advances it (it counts no steps)
    assert sb["step"].item() == {"sgd": 3.0, "lion": 4.0}[name]
    assert back.state[back.param_groups[0]["params"][2]][case["key"]].dtype == torch.float32


def test_foreign_and_version1_checkpoints():
    """An AdamW8bit checkpoint is refused by name (two quantized states, SGD8bit keeps one);
    a version-1 state_dict (codes under the live keys) still loads, bit-exactly."""
    p = torch.nn.Parameter(torch.randn(5000))
    adam = mpfused.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    adam.step()
    sgd = mpfused.SGD8bit([torch.nn.Parameter(p.detach().clone())], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .*\['absmax2', 'state2'\]"):
        sgd.load_state_dict(adam.state_dict())
    for name, case in CASES.items():
        pa = _params()
        oa = case["cls"](pa, backend="reference", **case["kw"])
        _set_grads(torch.Generator().manual_seed(9), pa)
        oa.step()
        oa.state_dict_version = 1
        v1 = oa.state_dict()
        assert v1["mpfused_8bit"]["version"] == 1 and v1["state"][0][case["key"]].dtype == \
            torch.uint8 and v1["state"][0][case["key"] + "_absmax"].shape == (25,)
        ob = case["cls"](_clone(pa), backend="reference", **case["kw"])
        ob.load_state_dict(v1)
        for a, b in zip(pa, ob.param_groups[0]["params"]):
            _state_equal(oa.state[a], ob.state[b])
