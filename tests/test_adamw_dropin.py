"""mpfused.AdamW / mpfused.Adam drop-in behaviour: state resets, dtype changes, hooks, master
refresh, legacy and foreign checkpoints (moved from tests/test_adamw.py)."""
import copy

import pytest
import torch

import mpfused
from tests.test_adamw import make_params
from tests.tolerances import TRAJ_TOL


# ---- drop-in behaviour: state resets, dtype changes, hooks, master refresh -----------------------
def _step_both(pairs, opts, n=3):
    for _ in range(n):
        for a, b in pairs:
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone().to(b.dtype)
        for o in opts:
            o.step()


@pytest.mark.parametrize("reset", ["clear", "new_dict", "del_one"])
def test_state_reset_starts_fresh_state(reset):
    """Resetting the state (as torch users do to restart moments) makes new state at the next
    step, as in torch; the plans must not keep updating the old tensors."""
    ref = make_params()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o_ref, o_ours = torch.optim.AdamW(ref, lr=1e-2), mpfused.AdamW(ours, lr=1e-2)
    pairs = list(zip(ref, ours))
    _step_both(pairs, (o_ref, o_ours))
    for o, ps in ((o_ref, ref), (o_ours, ours)):
        if reset == "clear":
            o.state.clear()
        elif reset == "new_dict":
            o.state = __import__("collections").defaultdict(dict)
        else:
            del o.state[ps[1]]
    _step_both(pairs, (o_ref, o_ours))
    for a, b in pairs:
        torch.testing.assert_close(b, a, **TRAJ_TOL)
        assert o_ours.state[b]["step"].item() == o_ref.state[a]["step"].item()
        torch.testing.assert_close(o_ours.state[b]["exp_avg"], o_ref.state[a]["exp_avg"],
                                   **TRAJ_TOL)
    assert len(o_ours.state_dict()["state"]) == len(ours)


def test_param_dtype_change_after_steps():
    """module.to(bf16) after steps: the params get fp32 masters taken from their (rounded)
    values and follow fp32 AdamW from there with the moments carried over; back to fp32 the
    master is dropped (an fp32 param is its own master)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = mpfused.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    model.to(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    o_ref = torch.optim.AdamW(ref, lr=1e-3)
    o_ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load would share tensors
    for _ in range(5):
        for p, r in zip(model.parameters(), ref):
            r.grad = torch.randn_like(r).bfloat16().float()
            p.grad = r.grad.bfloat16()
        opt.step()
        o_ref.step()
    for p, r in zip(model.parameters(), ref):
        st = opt.state[p]
        assert st["master"].dtype == torch.float32
        torch.testing.assert_close(st["master"], r.detach(), **TRAJ_TOL)
        assert torch.equal(p, st["master"].bfloat16())
    model.float()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert all("master" not in opt.state[p] for p in model.parameters())


def test_master_mode_and_amsgrad_changes_take_effect():
    """master_weights fp32 -> none -> fp32 takes a fresh master from the param (a stale one
    would overwrite it); amsgrad turned on mid-run gets its max_exp_avg_sq."""
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    opt = mpfused.AdamW([p], lr=1e-2)
    _step_both([(p, p)], (opt,), 2)
    opt.param_groups[0]["master_weights"] = "none"
    _step_both([(p, p)], (opt,), 2)
    assert "master" not in opt.state[p]
    before = p.detach().clone()
    opt.param_groups[0]["master_weights"] = "fp32"
    p.grad = torch.zeros_like(p)
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.state[p]["exp_avg"].zero_()
    opt.step()
    assert torch.equal(p, before)  # zero update from the param's own value
    opt.param_groups[0]["amsgrad"] = True
    _step_both([(p, p)], (opt,), 1)
    assert opt.state[p]["max_exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_refresh_master_weights_keeps_outside_writes(master):
    p = torch.nn.Parameter(torch.ones(8).bfloat16())
    opt = mpfused.AdamW([p], lr=1e-2, weight_decay=0.0, master_weights=master)
    p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        p.fill_(5.0)
    opt.refresh_master_weights()
    for key in ("exp_avg", "exp_avg_sq"):
        opt.state[p][key].zero_()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p, torch.full_like(p, 5.0))


def test_user_load_hooks_see_final_dict_and_restored_state():
    """A user's load pre-hook may return a new state_dict: ours validate and restore that one.
    The user's post-hooks run after ours (fp32 state already restored). A failed load leaves
    no stash behind."""
    p = torch.nn.Parameter(torch.randn(6).bfloat16())
    opt = mpfused.AdamW([p])
    _step_both([(p, p)], (opt,), 2)
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    o2 = mpfused.AdamW([q])

    def zero_moments(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        state_dict["state"][0]["exp_avg"].zero_()
        return state_dict

    seen = {}
    o2.register_load_state_dict_pre_hook(zero_moments)
    o2.register_load_state_dict_post_hook(
        lambda o: seen.update(dtype=o.state[q]["master"].dtype))
    o2.load_state_dict(sd)
    assert torch.count_nonzero(o2.state[q]["exp_avg"]) == 0
    assert torch.count_nonzero(opt.state[p]["exp_avg"]) > 0  # the caller's dict is untouched
    assert seen["dtype"] == torch.float32
    bad = copy.deepcopy(sd)
    bad["param_groups"].append(copy.deepcopy(bad["param_groups"][0]))
    with pytest.raises(ValueError):
        o2.load_state_dict(bad)
    assert not [a for a in vars(o2) if a.startswith("_loading")]


def test_legacy_integer_step_loads_as_torch_does():
    ref = make_params()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o_ref = torch.optim.AdamW(ref, lr=1e-2)
    _step_both([(a, a) for a in ref], (o_ref,), 3)
    sd = copy.deepcopy(o_ref.state_dict())
    for st in sd["state"].values():
        st["step"] = int(st["step"].item())
    o_ours = mpfused.AdamW(ours, lr=1e-2)
    o_ours.load_state_dict(sd)
    for a, b in zip(ref, ours):
        with torch.no_grad():
            b.copy_(a)
    _step_both(list(zip(ref, ours)), (o_ref, o_ours))
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


def test_adam_decoupled_weight_decay_as_torch():
    ref = make_params()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o_ref = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    o_ours = mpfused.Adam(ours, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    _step_both(list(zip(ref, ours)), (o_ref, o_ours), 10)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
    with pytest.raises(ValueError, match="always decouples"):
        mpfused.AdamW(make_params(), decoupled_weight_decay=False)
    # as torch: an Adam (coupled) state_dict loaded into AdamW stays decoupled
    o_w = mpfused.AdamW(make_params())
    o_w.load_state_dict(mpfused.Adam(make_params()).state_dict())
    assert o_w.param_groups[0]["decoupled_weight_decay"] is True


def test_8bit_checkpoint_into_32bit_optimizer_is_a_clear_error():
    p = torch.nn.Parameter(torch.randn(5000))
    o8 = mpfused.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    o8.step()
    o32 = mpfused.AdamW([torch.nn.Parameter(p.detach().clone())])
    with pytest.raises(ValueError, match="8-bit optimizer state.*to_torch_state_dict"):
        o32.load_state_dict(o8.state_dict())
    o32.load_state_dict(o8.to_torch_state_dict())  # the documented way
    assert o32.state[o32.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32


def test_bitsandbytes_checkpoint_into_32bit_optimizer_is_a_clear_error():
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(torch.randn(5000))
    o = bnb.optim.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    o.step()
    o32 = mpfused.AdamW([torch.nn.Parameter(p.detach().clone())])
    with pytest.raises(ValueError, match="8-bit optimizer state"):
        o32.load_state_dict(o.state_dict())
