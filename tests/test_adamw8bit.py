"""mpfused.AdamW8bit / Adam8bit: backends agree, bitsandbytes' 50-step accuracy test against
torch.optim.AdamW, checkpoints (bit-identical continuation, errors, torch and bnb formats), the
scaler contract, 32-bit routing, a bitsandbytes cross-check and a short training parity run."""
import copy
import io
import warnings

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.ops import adam8bit as ops
from mpfused.optim import keep_32bit_state
from tests.tolerances import OP_TOL

OP_UNDER_TEST = "adam8bit_step_"
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2)


def _random_state(n, block, gen):
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    c1, a1 = qm.quantize_blockwise(m, qm.signed_map(), block)
    c2, a2 = qm.quantize_blockwise(v, qm.unsigned_map(), block)
    return c1, c2, a1, a2


# (param dtype, master mode): fp32; fp16 + fp32 master / none; bf16 + every mode
CASES = [(torch.float32, 0), (torch.float16, 1), (torch.float16, 0), (torch.bfloat16, 1),
         (torch.bfloat16, 2), (torch.bfloat16, 3), (torch.bfloat16, 0)]


@pytest.mark.parametrize("dtype,mode", CASES, ids=[f"{str(d)[6:]}-m{m}" for d, m in CASES])
def test_backends_agree_with_reference(device, backend, dtype, mode):
    sizes = [700, 256, 1, 0, 300]  # partial blocks, a 1-element tensor, an empty one
    block = 64 if backend == "triton" else 256
    gen = torch.Generator().manual_seed(1234)
    results = {}
    for name in (backend, "reference"):
        gen.manual_seed(1234)
        params, grads, c1s, c2s, a1s, a2s, masters, steps = ([] for _ in range(8))
        for n in sizes:
            p32 = torch.randn(n, generator=gen) * 0.1
            params.append(p32.to(dtype).to(device))
            grads.append((torch.randn(n, generator=gen) * 0.01).to(dtype).to(device))
            c1, c2, a1, a2 = _random_state(n, block, gen)
            c1s.append(c1.to(device)), c2s.append(c2.to(device))
            a1s.append(a1.to(device)), a2s.append(a2.to(device))
            if mode == 1:
                masters.append((p32 + 1e-5).to(device))
            elif mode == 2:
                masters.append(torch.randint(-2**15, 2**15, (n,), generator=gen,
                                             dtype=torch.int16).to(device))
            steps.append(torch.full((), 4.0, device=device))
        h = HYPER
        ops.adam8bit_step_(params, grads, c1s, c2s, a1s, a2s, masters, steps,
                           qm.signed_map(device), qm.unsigned_map(device), block_size=block,
                           lr=h["lr"], lr_tensor=None,
                           beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["wd"],
                           maximize=False, decoupled=True, master_mode=mode,
                           grad_scale=torch.tensor(2.0, device=device), found_inf=torch.tensor(0.0,
                                                                                               device=device),
                           norm_sq=torch.tensor(4.0, device=device), max_grad_norm=1.0, seed=7,
                           backend=name)
        results[name] = (params, c1s, c2s, a1s, a2s, masters, steps)
    got, ref = results[backend], results["reference"]
    rtol, atol = OP_TOL[dtype]
    for i in range(len(sizes)):
        torch.testing.assert_close(got[0][i].float(), ref[0][i].float(), rtol=rtol, atol=atol)
        for k in (1, 2):  # codes: equal except where a moment is within rounding of a threshold
            diff = (got[k][i].int() - ref[k][i].int()).abs()
            assert int((diff > 1).sum()) == 0 and int((diff > 0).sum()) <= 2
        for k in (3, 4):
            torch.testing.assert_close(got[k][i], ref[k][i], rtol=1e-6, atol=0)
        if mode == 1:
            torch.testing.assert_close(got[5][i], ref[5][i], rtol=1e-6, atol=1e-9)
        assert got[6][i].item() == ref[6][i].item() == 5.0


def test_found_inf_skips_everything_bit_identical(device, backend):
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    c1, c2, a1, a2 = (t.to(device) for t in _random_state(n, 256, gen))
    master = p.float() + 1e-4
    step = torch.full((), 3.0, device=device)
    before = [t.clone() for t in (p, c1, c2, a1, a2, master, step)]
    g = torch.full((n,), float("inf"), dtype=torch.bfloat16, device=device)
    ops.adam8bit_step_([p], [g], [c1], [c2], [a1], [a2], [master], [step], qm.signed_map(device),
                       qm.unsigned_map(device), block_size=256, lr=1e-3, lr_tensor=None, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
                       decoupled=True, master_mode=1, grad_scale=torch.tensor(65536.0,
                                                                              device=device),
                       found_inf=torch.tensor(1.0, device=device), norm_sq=None, max_grad_norm=0.0,
                       seed=0, backend=backend)
    for a, b in zip((p, c1, c2, a1, a2, master, step), before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)


# ---- optimizer ------------------------------------------------------------------------------
def _sync_torch_from_8bit(opt8, p8, torch_opt, pt):
    """bitsandbytes' test: after every step the reference takes the 8-bit side's values."""
    with torch.no_grad():
        for a, b in zip(pt, p8):
            a.copy_(b)
    torch_opt.load_state_dict(opt8.to_torch_state_dict())


@pytest.fixture
def one_thread():
    """Many small torch ops: one thread is faster and steadier on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


_ISA_SCRIPT = r"""
import hashlib, sys, torch
from mpfused import quant_maps as qm
from mpfused.ops import adam8bit as ops
seed = int(sys.argv[1])
gen = torch.Generator().manual_seed(seed)
h = hashlib.sha256()
# every dtype / master mode; sizes with partial tiles and blocks, and a multi-chunk tensor
for dtype, mode in [(torch.float32, 0), (torch.float16, 1), (torch.bfloat16, 2), (torch.bfloat16, 3)]:
    sizes = [1, 63, 64, 65, 1000, 70001]
    ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
    c1s, c2s, a1s, a2s = [], [], [], []
    for n in sizes:
        c1, a1 = qm.quantize_blockwise(torch.randn(n, generator=gen) * 1e-3, qm.signed_map(), 256)
        c2, a2 = qm.quantize_blockwise(torch.rand(n, generator=gen) * 1e-5, qm.unsigned_map(), 256)
        c1s.append(c1), c2s.append(c2), a1s.append(a1), a2s.append(a2)
    masters = ([p.float() + 1e-5 for p in ps] if mode == 1 else
               [torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int16) for n in sizes]
               if mode == 2 else [])
    steps = [torch.zeros(()) for _ in sizes]
    for _ in range(3):
        grads = [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for n in sizes]
        ops.adam8bit_step_(ps, grads, c1s, c2s, a1s, a2s, masters, steps, qm.signed_map(),
                           qm.unsigned_map(), block_size=256, lr=1e-3, lr_tensor=None, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False,
                           decoupled=True, master_mode=mode, backend="native")
    for t in ps + c1s + c2s + a1s + a2s + masters:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.skipif(not mpfused.ops.OPS[OP_UNDER_TEST].native_available("cpu"),
                    reason="no native extension")
def test_every_cpu_isa_build_is_bit_identical():
    """The 8-bit CPU kernel is built per ISA (baseline, x86-64-v3, v4, v4 + VBMI byte-permute
    decode); MPFUSED_CPU_ISA caps the one picked. Every build must give the same bytes."""
    import os
    import subprocess
    import sys
    seed = str(int(torch.randint(0, 2**31, ()).item()))
    # the four processes at once: most of each is importing torch and mpfused
    procs = {isa: subprocess.Popen([sys.executable, "-c", _ISA_SCRIPT, seed],
                                   env=dict(os.environ, MPFUSED_CPU_ISA=isa), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for isa in ("base", "v3", "v4", "vbmi")}
    digests = {}
    for isa, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0, (isa, err)
        digests[isa] = out.strip()
    assert len(set(digests.values())) == 1, digests


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
