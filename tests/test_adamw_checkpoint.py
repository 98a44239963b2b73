"""mpfused.AdamW / mpfused.Adam checkpoints: save/load continues identically, torch state_dict
round trip, wrong shapes / dtypes rejected before any change, pickle and deepcopy (moved from
tests/test_adamw.py)."""
import copy
import io

import pytest
import torch

import mpfused
from tests.test_adamw import make_params
from tests.tolerances import TRAJ_TOL

OP_UNDER_TEST = "adam_step_"


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_save_load_continues_identically(device, backend, master):
    def train(opt, params, n, gen):
        for _ in range(n):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p)
            opt.step()

    n = 4 if backend == "triton" else 10
    base = make_params(torch.bfloat16, device=device)
    a = [torch.nn.Parameter(p.detach().clone()) for p in base]
    oa = mpfused.AdamW(a, lr=1e-2, master_weights=master, backend=backend)
    train(oa, a, 2 * n, torch.Generator().manual_seed(3))

    b = [torch.nn.Parameter(p.detach().clone()) for p in base]
    ob = mpfused.AdamW(b, lr=1e-2, master_weights=master, backend=backend)
    gen = torch.Generator().manual_seed(3)
    train(ob, b, n, gen)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in b], "opt": ob.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, map_location="cpu", weights_only=True)
    c = [torch.nn.Parameter(t.to(device)) for t in ck["model"]]
    oc = mpfused.AdamW(c, lr=1e-2, master_weights=master, backend=backend)
    oc.load_state_dict(ck["opt"])
    for p in c:  # the torch cast pitfall: fp32 state must stay fp32, remainder int16
        st = oc.state[p]
        assert st["exp_avg"].dtype == torch.float32 and st["step"].dtype == torch.float32
        key = "master" if master == "fp32" else "master_remainder"
        assert st[key].dtype == (torch.float32 if master == "fp32" else torch.int16)
    train(oc, c, n, gen)
    for x, y in zip(a, c):
        assert torch.equal(x.detach(), y.detach())


def test_torch_state_dict_round_trip():
    ref = make_params()
    o_ref = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(3):
        for p in ref:
            p.grad = torch.randn_like(p)
        o_ref.step()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o_ours = mpfused.AdamW(ours, lr=1e-2)
    o_ours.load_state_dict(copy.deepcopy(o_ref.state_dict()))  # as through a file: no aliasing
    for _ in range(3):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        o_ref.step()
        o_ours.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
    back = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    o_back = torch.optim.AdamW(back, lr=1e-2)
    o_back.load_state_dict(copy.deepcopy(o_ours.state_dict()))
    assert o_back.state[back[0]]["step"].item() == 6


def test_bf16_torch_checkpoint_gets_a_master():
    """A torch.optim.AdamW state for bf16 params (bf16 moments) loads as fp32 state + master."""
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    o = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    o.step()
    q = torch.nn.Parameter(p.detach().clone())
    ours = mpfused.AdamW([q])
    ours.load_state_dict(o.state_dict())
    st = ours.state[q]
    assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["master"], q.detach().float())


def test_state_dict_with_wrong_shapes_is_rejected_before_any_change():
    ps = make_params()
    opt = mpfused.AdamW(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = torch.zeros(3)
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(3,\)"):
        opt.load_state_dict(sd)
    for k, v in opt.state[ps[0]].items():
        assert torch.equal(v, before[k])


def test_state_dict_with_wrong_dtypes_is_rejected():
    p = torch.nn.Parameter(torch.randn(5).bfloat16())
    opt = mpfused.AdamW([p], master_weights="remainder")
    p.grad = torch.randn_like(p)
    opt.step()
    for key, bad in (("exp_avg", torch.zeros(5, dtype=torch.int64)),
                     ("master_remainder", torch.zeros(5))):
        sd = copy.deepcopy(opt.state_dict())
        sd["state"][0][key] = bad
        with pytest.raises(ValueError, match=rf"state\[0\]\['{key}'\] has dtype"):
            opt.load_state_dict(sd)


@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.AdamW8bit])
def test_pickle_and_deepcopy_keep_options_and_fp32_state(cls):
    """torch's Optimizer pickles only defaults/state/param_groups: a copy must keep our options
    (max_grad_norm, backend, seed, 8-bit defaults) and our state_dict hooks, so that it steps like
    the original and a later load_state_dict keeps fp32 masters and moments fp32."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 80).bfloat16())
    opt = cls([p], lr=1e-2, max_grad_norm=0.5, seed=7)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for clone in (copy.deepcopy(opt), torch.load(io.BytesIO(_saved(opt)), weights_only=False)):
        q = clone.param_groups[0]["params"][0]
        assert clone.max_grad_norm == 0.5 and clone._seed == 7
        # same next step as the original from the same state
        ref = copy.deepcopy(opt)
        for o, x in ((clone, q), (ref, ref.param_groups[0]["params"][0])):
            x.grad = (p.grad * 1000).clone()  # clipping changes the update if max_grad_norm kept
            o.step()
        assert torch.equal(q, ref.param_groups[0]["params"][0])
        clone.load_state_dict(sd)
        assert clone.state[q]["master"].dtype == torch.float32
        if cls is mpfused.AdamW:
            assert clone.state[q]["exp_avg"].dtype == torch.float32
        else:
            assert clone.state[q]["exp_avg"].dtype == torch.uint8


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
