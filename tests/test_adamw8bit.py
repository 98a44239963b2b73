"""mpfused.AdamW8bit / Adam8bit: bitsandbytes' 50-step accuracy test against torch.optim.AdamW,
the scaler contract, 32-bit routing, a bitsandbytes cross-check and a short training parity run.
The op on every backend: tests/test_adam8bit_kernels.py; checkpoints (bit-identical continuation,
errors, torch and bnb formats): tests/test_adamw8bit_checkpoint.py."""
import warnings

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.optim import keep_32bit_state
from tests.test_adam8bit_kernels import _random_state


# ---- optimizer ------------------------------------------------------------------------------
def _sync_torch_from_8bit(opt8, p8, torch_opt, pt):
    """bitsandbytes' test: after every step the reference takes the 8-bit side's values."""
    with torch.no_grad():
        for a, b in zip(pt, p8):
            a.copy_(b)
    torch_opt.load_state_dict(opt8.to_torch_state_dict())




def test_50_steps_against_torch_adamw_resynced(one_thread):
    # bitsandbytes test_optimizer8bit thresholds (REFERENCE 3.7), fp32, with a partial block.
    torch.manual_seed(0)
    shapes = [(1024, 32), (256, 1024), (64, 4097)]
    p8 = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    pt = [torch.nn.Parameter(p.detach().clone()) for p in p8]
    opt8 = mpfused.AdamW8bit(p8, lr=1e-3, weight_decay=1e-2)
    optt = torch.optim.AdamW(pt, lr=1e-3, weight_decay=1e-2)
    errs, rels = [], []
    for step in range(50):
        for a, b in zip(p8, pt):
            a.grad = torch.randn_like(a) * 0.01
            b.grad = a.grad.clone()
        opt8.step()
        optt.step()
        tsd = opt8.to_torch_state_dict()["state"]
        for i, (a, b) in enumerate(zip(p8, pt)):
            for key in ("exp_avg", "exp_avg_sq"):
                ours, theirs = tsd[i][key], optt.state[b][key]
                bad = ~torch.isclose(theirs, ours, atol=3e-3, rtol=1e-3)
                assert int(bad.sum()) < 20, (step, i, key)
            err = (a.detach() - b.detach()).abs()
            errs.append(err.mean().item())
            rels.append((err / (b.detach().abs() + 1e-9)).mean().item())
        _sync_torch_from_8bit(opt8, p8, optt, pt)
    assert sum(errs) / len(errs) < 6e-5 and sum(rels) / len(rels) < 6e-4


def _model_params(dtype=torch.float32):
    torch.manual_seed(3)
    emb = torch.nn.Embedding(100, 64)           # 6400 elements, kept 32-bit below
    lin = torch.nn.Linear(64, 128)               # weight 8-bit, bias fp32 (small)
    big = torch.nn.Parameter(torch.randn(300, 50) * 0.1)  # 15000: 8-bit, partial last block
    mods = torch.nn.ModuleDict({"emb": emb, "lin": lin}).to(dtype)
    return mods, [emb.weight, lin.weight, lin.bias, torch.nn.Parameter(big.detach().to(dtype))]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)


def test_state_layout_routing_and_bytes_per_param():
    big = torch.nn.Parameter(torch.randn(1024, 1024))
    small = torch.nn.Parameter(torch.randn(4095))
    forced = torch.nn.Parameter(torch.randn(8192))
    grouped = torch.nn.Parameter(torch.randn(8192))
    opt = mpfused.AdamW8bit([{"params": [big, small, forced]},
                             {"params": [grouped], "optim_bits": 32}])
    keep_32bit_state([forced])
    for p in (big, small, forced, grouped):
        p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[big]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg"].shape == big.shape and st["exp_avg_absmax"].shape == (4096,)
    for p in (small, forced, grouped):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    nbytes = sum(t.numel() * t.element_size() for t in st.values())
    assert nbytes / big.numel() <= 2.05
    # An override after the first step converts the existing state (dequantized).
    before = qm.dequantize_blockwise(st["exp_avg"], st["exp_avg_absmax"], qm.signed_map(), 256)
    keep_32bit_state(big)
    big.grad = torch.zeros_like(big)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert opt.state[big]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(opt.state[big]["exp_avg"], before * 0.9)
    del big._mpfused_optim_bits


def test_constructor_validation_and_legacy_kwargs():
    p = [torch.nn.Parameter(torch.randn(10))]
    for bad in (100, 32, 8192, 0):
        with pytest.raises(ValueError, match="block_size"):
            mpfused.AdamW8bit(p, block_size=bad)
    with pytest.raises(ValueError, match="amsgrad"):
        mpfused.AdamW8bit(p, amsgrad=True)
    with pytest.raises(ValueError, match="optim_bits"):
        mpfused.AdamW8bit([{"params": p, "optim_bits": 16}])
    with pytest.raises(TypeError):
        mpfused.AdamW8bit(p, not_an_option=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpfused.AdamW8bit(p, optim_bits=32, args=None, percentile_clipping=100, block_wise=True,
                          is_paged=False, max_unorm=0.0, skip_zeros=False)
    with pytest.warns(UserWarning, match="percentile_clipping"):
        mpfused.AdamW8bit(p, percentile_clipping=5)
    opt = mpfused.Adam8bit(p)
    assert opt.defaults["weight_decay"] == 0.0 and not opt._decoupled
    assert opt.defaults["block_size"] == 256 and opt.defaults["min_8bit_size"] == 4096


def test_grad_scaler_contract_and_fused_clipping():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 100)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = mpfused.AdamW8bit(params, max_grad_norm=0.5)
    ropt = mpfused.AdamW8bit(ref)
    scaler = mpfused.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # initializes the scale, as scaler.scale(loss) would
    _grads(params, 0)
    _grads(ref, 0)
    for p in params:
        p.grad.mul_(1024.0)  # as scaler.scale(loss).backward() would produce
    scaler.step(opt)
    scaler.update()
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    ropt.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    # An overflow: the scaler skips, nothing changes, step counters included.
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    _grads(params, 1)
    params[0].grad[0, 0] = float("inf")
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    for p, b, s in zip(params, before, states):
        assert torch.equal(p.detach(), b)
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k


def test_one_step_matches_bitsandbytes_from_identical_state():
    """bitsandbytes' CPU AdamW8bit from the same codes/absmax. bnb's CPU path decays before the
    update (its CUDA kernel after: a second-order difference) and rounds with a 65536-bin table
    plus no sign rule, so: params within 3e-8 (updates are ~5e-3), absmax within 3e-6 relative, codes equal
    for >= 99.5% of elements and never more than one top-decade step apart once decoded."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    shape = (512, 300)
    p0 = torch.randn(shape) * 0.1
    c1, c2, a1, a2 = _random_state(p0.numel(), 256, torch.Generator().manual_seed(1))
    c1, c2 = c1.view(shape), c2.view(shape)
    g = torch.randn(shape) * 0.01
    pa, pb = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    oa = mpfused.AdamW8bit([pa], lr=1e-3, weight_decay=1e-2)
    ob = bnb.optim.AdamW8bit([pb], lr=1e-3, weight_decay=1e-2)
    ob.init_state(ob.param_groups[0], pb, 0, 0)
    sb = ob.state[pb]
    for key, val in (("state1", c1), ("state2", c2), ("absmax1", a1), ("absmax2", a2)):
        sb[key].copy_(val)
    sb["step"] = 9
    oa.load_state_dict(ob.state_dict())  # bnb's format loads as is: interchangeable states
    sa = oa.state[pa]
    assert torch.equal(sa["exp_avg"], c1) and torch.equal(sa["exp_avg_sq_absmax"], a2)
    assert sa["step"].item() == 9.0
    pa.grad, pb.grad = g.clone(), g.clone()
    oa.step()
    ob.step()
    torch.testing.assert_close(pa.detach(), pb.detach(), rtol=2.4e-7, atol=3e-8)
    for key, bkey, akey, bakey, qmap, step in (
            ("exp_avg", "state1", "exp_avg_absmax", "absmax1", qm.signed_map(), 0.0141),
            ("exp_avg_sq", "state2", "exp_avg_sq_absmax", "absmax2", qm.unsigned_map(), 0.00704)):
        torch.testing.assert_close(sa[akey], sb[bakey], rtol=3e-6, atol=0)
        assert (sa[key] != sb[bkey]).float().mean().item() < 5e-3
        da = qm.dequantize_blockwise(sa[key], sa[akey], qmap, 256)
        db = qm.dequantize_blockwise(sb[bkey], sb[bakey], qmap, 256)
        scale = sa[akey].repeat_interleave(256).view(shape)
        assert ((da - db).abs() / scale).max().item() <= step


def test_training_parity_with_32bit(one_thread):
    """A small MLP (the hidden weights get 8-bit state): final loss within 1% of fp32-state
    AdamW."""
    def run(opt_cls):
        torch.manual_seed(0)
        x = torch.randn(4096, 32)
        teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                      torch.nn.Linear(64, 10))
        with torch.no_grad():
            y = teacher(x).argmax(1)
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        opt = opt_cls(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(2)
        for _ in range(300):
            idx = torch.randint(0, 4096, (256,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x), y).item(), opt
    ref, _ = run(mpfused.AdamW)
    got, opt = run(mpfused.AdamW8bit)
    assert sum(s["exp_avg"].dtype == torch.uint8 for s in opt.state.values()) == 2
    assert abs(got - ref) <= 0.01 * ref, (got, ref)


def test_adam8bit_decoupled_weight_decay_is_adamw8bit():
    """bitsandbytes' Adam8bit decouples weight decay; mpfused.Adam8bit follows torch.optim.Adam
    unless decoupled_weight_decay=True, which then steps exactly as AdamW8bit."""
    torch.manual_seed(0)
    base = torch.randn(5000)
    a = torch.nn.Parameter(base.clone())
    b = torch.nn.Parameter(base.clone())
    c = torch.nn.Parameter(base.clone())
    oa = mpfused.Adam8bit([a], lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    ob = mpfused.AdamW8bit([b], lr=1e-2, weight_decay=0.1)
    oc = mpfused.Adam8bit([c], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(5000)
        for p, o in ((a, oa), (b, ob), (c, oc)):
            p.grad = g.clone()
            o.step()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    with pytest.raises(ValueError, match="always decouples"):
        mpfused.AdamW8bit([torch.nn.Parameter(base.clone())], decoupled_weight_decay=False)
