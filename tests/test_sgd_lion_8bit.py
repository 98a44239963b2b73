"""mpfused.SGD8bit / mpfused.Lion8bit: bitsandbytes' SGD8bit (momentum, dampening 0) and Lion8bit on
CPU step for step, torch.optim.SGD step for step, the GradScaler skip, the min_8bit_size split and
16-bit masters. Save / load / continue and cross-loads with bitsandbytes and torch:
tests/test_sgd_lion_8bit_checkpoint.py.

Error bounds, measured on the reference backend (fp32 params of 64x100, 5000 and 300 elements,
seed 0, 20 steps; bitsandbytes 0.50.2's CPU path) and asserted below with the margin stated:
* From identical state every step (ours loads bitsandbytes' state_dict as is): params within
  2.4e-7 (SGD) / 4.8e-7 (Lion) of O(1) values, i.e. one or two fp32 ulps (bitsandbytes rounds each
  torch op, the reference once); absmax within 1.2e-7 relative; codes equal for >= 99.7% of
  elements and, decoded, never more than one code step of the signed map's top decade (0.0141 *
  absmax) apart: bitsandbytes' CPU encoder rounds through a 65536-bin table and has no sign rule
  (test_adamw8bit.py states the same bound for AdamW8bit); fp32 state of small params within
  9.5e-7 absolute (SGD: buffers reach ~4, and m*buf + g cancels in places) / 7.5e-9 (Lion).
* Free-running 30 steps: the distance of the 8-bit trajectory to the fp32 optimizer's, relative to
  the distance travelled (RMS over each param), is 0.019-0.020 for SGD and 0.056-0.057 for Lion
  over seeds 0-2, bitsandbytes' own within 0.2% of ours.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.optim._masters import master_from_remainder

SHAPES = ((64, 100), (5000,), (300,))  # 8-bit (25 blocks), 8-bit (short last block), fp32 state
TOP_STEP = 0.0141  # one code step of the signed map's top decade, relative to the block absmax
CASES = {
    "sgd": dict(cls=mpfused.SGD8bit, bnb="SGD8bit", fp32=torch.optim.SGD, key="momentum_buffer",
                kw=dict(lr=0.01, momentum=0.9, weight_decay=1e-2)),
    "lion": dict(cls=mpfused.Lion8bit, bnb="Lion8bit", fp32=mpfused.Lion, key="exp_avg",
                 kw=dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}
# The reference always; the automatic choice too once the native 8-bit CPU kernels exist.
BACKENDS = ["reference"] + (["auto"] if all("native" in OPS[op].available("cpu")
                                            for op in ("sgd8bit_step_", "lion8bit_step_")) else [])


def _backend(name):
    return None if name == "auto" else name


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _set_grads(gen, *param_lists, dtype=None):
    """The same grads (rounded to `dtype` when given) into every list of params."""
    for ps in zip(*param_lists):
        g = torch.randn(ps[0].shape, generator=gen)
        if dtype is not None:
            g = g.to(dtype)
        for p in ps:
            p.grad = g.to(p.dtype)


def _bnb_class(name):
    bnb = pytest.importorskip("bitsandbytes")
    return getattr(bnb.optim, CASES[name]["bnb"])


def _decoded(codes, absmax, block=256):
    return qm.dequantize_blockwise(codes, absmax, qm.signed_map(), block)


def _assert_near_bnb(sa, sb, key):
    """One param's 8-bit state against bitsandbytes' after one step from the same state."""
    torch.testing.assert_close(sa[key + "_absmax"], sb["absmax1"], rtol=3e-7, atol=0)
    assert (sa[key] != sb["state1"]).float().mean().item() < 5e-3
    scale = sa[key + "_absmax"].repeat_interleave(256)[:sa[key].numel()].view(sa[key].shape)
    diff = (_decoded(sa[key], sa[key + "_absmax"]) - _decoded(sb["state1"], sb["absmax1"])).abs()
    assert (diff / scale).max().item() <= TOP_STEP


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_steps_match_bitsandbytes_from_identical_state(name, backend):
    case = CASES[name]
    pa = _params()
    pb = _clone(pa)
    oa = case["cls"](pa, backend=_backend(backend), **case["kw"])
    ob = _bnb_class(name)(pb, **case["kw"])
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        if step:  # both continue from bitsandbytes' state: its format loads as is
            oa.load_state_dict(copy.deepcopy(ob.state_dict()))
            sa, sb = oa.state[pa[0]], ob.state[pb[0]]
            assert torch.equal(sa[case["key"]], sb["state1"]) and sa["step"].item() == step
            with torch.no_grad():
                for a, b in zip(pa, pb):
                    a.copy_(b)
        _set_grads(gen, pa, pb)
        oa.step()
        ob.step()
        for a, b in zip(pa, pb):
            torch.testing.assert_close(a, b, rtol=2.4e-7, atol=1e-7)
        for i in (0, 1):
            _assert_near_bnb(oa.state[pa[i]], ob.state[pb[i]], case["key"])
        small_a, small_b = oa.state[pa[2]][case["key"]], ob.state[pb[2]]["state1"]
        assert small_a.dtype == small_b.dtype == torch.float32
        # absolute: bitsandbytes rounds m*buf and + g apart, which cancel in places (2 ulps of
        # the O(4) operands)
        torch.testing.assert_close(small_a, small_b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_free_running_error_vs_fp32_is_bitsandbytes(name, backend):
    case = CASES[name]
    p0 = _params()
    runs = [_clone(p0) for _ in range(3)]
    opts = [case["cls"](runs[0], backend=_backend(backend), **case["kw"]),
            _bnb_class(name)(runs[1], **case["kw"]), case["fp32"](runs[2], **case["kw"])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        _set_grads(gen, *runs)
        for opt in opts:
            opt.step()

    def rel_rms(ps):
        return max(((a - r).norm() / (r - x).norm()).item() for a, r, x in zip(ps, runs[2], p0))

    ours, theirs = rel_rms(runs[0]), rel_rms(runs[1])
    assert ours <= {"sgd": 0.025, "lion": 0.07}[name]  # measured 0.0196 / 0.0569
    assert ours <= 1.02 * theirs


TORCH_SGD = {"momentum": dict(momentum=0.9), "dampening": dict(momentum=0.9, dampening=0.5),
             "nesterov-l2": dict(momentum=0.8, nesterov=True, weight_decay=0.1),
             "maximize": dict(momentum=0.9, maximize=True),
             "tensor-lr": dict(momentum=0.9, lr=torch.tensor(0.02))}


@pytest.mark.parametrize("kw", TORCH_SGD.values(), ids=TORCH_SGD.keys())
def test_sgd8bit_steps_match_torch_sgd_from_identical_state(kw):
    """torch.optim.SGD's semantics (dampening, Nesterov, maximize, tensor lr) on 8-bit state:
    each step torch loads to_torch_state_dict() (the dequantized buffers) and both step."""
    kw = {"lr": 0.01, **kw}
    pa = _params()
    pt = _clone(pa)
    oa = mpfused.SGD8bit(pa, backend="reference", **kw)
    ot = torch.optim.SGD(pt, **kw)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        if step:
            ot.load_state_dict(oa.to_torch_state_dict())
            with torch.no_grad():
                for a, t in zip(pa, pt):
                    t.copy_(a)
        _set_grads(gen, pa, pt)
        oa.step()
        ot.step()
        for a, t in zip(pa, pt):
            torch.testing.assert_close(a, t, rtol=2.4e-7, atol=1e-7)
        st = ot.state[pt[0]]["momentum_buffer"]
        sa = oa.state[pa[0]]
        scale = sa["momentum_buffer_absmax"].repeat_interleave(256).view(st.shape)
        assert ((_decoded(sa["momentum_buffer"], sa["momentum_buffer_absmax"]) - st).abs()
                / scale).max().item() <= TOP_STEP / 2  # nearest code: half a step at most


# (param dtype, master_weights): fp32; bf16 with every mode; fp16 with an fp32 master
MASTER_CASES = [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"),
                (torch.bfloat16, "none"), (torch.float16, "fp32")]
MASTER_IDS = [f"{str(d)[6:]}-{m}" for d, m in MASTER_CASES]


def _state_equal(sa, sb):
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("dtype,master", MASTER_CASES, ids=MASTER_IDS)
@pytest.mark.parametrize("name", CASES)
def test_scaler_skip_changes_nothing(name, dtype, master):
    case = CASES[name]
    params = _params(dtype)
    opt = case["cls"](params, master_weights=master, backend="reference", **case["kw"])
    scaler = mpfused.GradScaler("cpu", init_scale=2.0 ** 10)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        _set_grads(gen, params)
        scaler.scale(torch.zeros(()))  # as a loss would: the scale exists from here on
        scaler.step(opt)
        scaler.update()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])
    _set_grads(gen, params)
    params[1].grad[3] = float("inf")
    scale = scaler.get_scale()
    scaler.scale(torch.zeros(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    for a, b in zip(before[0], params):
        assert torch.equal(a.view(torch.uint8), b.detach().view(torch.uint8))
    after = opt.state_dict()["state"]
    for pid, st in before[1].items():
        _state_equal(after[pid], st)  # step counters, codes, absmax and masters included
    assert after[0]["step"].item() == 2.0


@pytest.mark.parametrize("name", CASES)
def test_min_8bit_size_split_and_32bit_overrides(name):
    """Params below min_8bit_size (and optim_bits=32 groups, keep_32bit_state params) keep fp32
    state and take the 32-bit op, bit-identical to the 32-bit optimizer; the rest are 8-bit; a
    changed min_8bit_size converts the state at the next step."""
    case = CASES[name]
    cls32 = {"sgd": mpfused.SGD, "lion": mpfused.Lion}[name]
    gen = torch.Generator().manual_seed(7)
    big, edge, small, kept, grouped = (torch.nn.Parameter(torch.randn(n, generator=gen))
                                       for n in (4096, 4095, 1, 5000, 8192))
    mpfused.keep_32bit_state(kept)
    try:
        opt = case["cls"]([{"params": [big, edge, small, kept]},
                           {"params": [grouped], "optim_bits": 32}], backend="reference",
                          **case["kw"])
        twins = [_clone(ps) for ps in ([edge, small, kept], [grouped])]
        ref = cls32([{"params": twins[0]}, {"params": twins[1]}], backend="reference",
                    **case["kw"])
        for _ in range(3):
            _set_grads(gen, [edge, small, kept, grouped], twins[0] + twins[1])
            big.grad = torch.randn(big.shape, generator=gen)
            opt.step()
            ref.step()
        assert opt.state[big][case["key"]].dtype == torch.uint8
        assert [b.state["eight"] for b in opt._plans[0].buckets] == [False, True]
        for p, q in zip([edge, small, kept, grouped], twins[0] + twins[1]):
            assert opt.state[p][case["key"]].dtype == torch.float32
            assert torch.equal(p, q) and torch.equal(opt.state[p][case["key"]],
                                                     ref.state[q][case["key"]])
    finally:
        mpfused.keep_32bit_state(kept, enabled=False)
    st = opt.state[big]
    value = _decoded(st[case["key"]], st[case["key"] + "_absmax"])
    opt.param_groups[0].update(min_8bit_size=8192, lr=0.0, weight_decay=0.0)
    big.grad = torch.zeros_like(big)
    opt.step()
    assert opt.state[big][case["key"]].dtype == torch.float32
    assert case["key"] + "_absmax" not in opt.state[big]
    decay = 0.9 if name == "sgd" else 0.99  # one zero-grad step from the dequantized state
    torch.testing.assert_close(opt.state[big][case["key"]], value * decay, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,master", MASTER_CASES[1:3] + MASTER_CASES[4:],
                         ids=MASTER_IDS[1:3] + MASTER_IDS[4:])
@pytest.mark.parametrize("name", CASES)
def test_masters_follow_the_fp32_run(name, dtype, master, backend):
    """A 16-bit param's master (fp32, or bf16 + int16 remainder) is the value an fp32 param
    takes from the same grads, bit for bit, with the same codes; the param is it rounded."""
    case = CASES[name]
    p16 = _params(dtype)
    p32 = [torch.nn.Parameter(p.detach().float()) for p in p16]
    o16 = case["cls"](p16, master_weights=master, backend=_backend(backend), **case["kw"])
    o32 = case["cls"](p32, backend=_backend(backend), **case["kw"])
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        _set_grads(gen, p16, p32, dtype=dtype)  # grads the 16-bit dtype holds exactly
        o16.step()
        o32.step()
    for a, b in zip(p16, p32):
        s16, s32 = o16.state[a], o32.state[b]
        m = s16["master"] if master == "fp32" else master_from_remainder(a, s16["master_remainder"])
        assert m.dtype == torch.float32 and torch.equal(m, b)
        assert torch.equal(a, b.to(dtype))
        assert torch.equal(s16[case["key"]], s32[case["key"]])


def test_constructors_groups_and_exports():
    p = torch.nn.Parameter(torch.randn(5000))
    with pytest.raises(NotImplementedError, match="SGD without momentum"):
        mpfused.SGD8bit([p], lr=0.1)
    with pytest.raises(ValueError, match="Invalid momentum value"):
        mpfused.SGD8bit([p], lr=0.1, momentum=-0.5)
    opt = mpfused.SGD8bit([p], lr=0.1, momentum=0.9)
    extra = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="mpfused.SGD8bit: param group momentum=0"):
        opt.add_param_group({"params": [extra], "momentum": 0})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["momentum"] = 0.0
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\] momentum=0.0"):
        opt.step()
    for cls in (mpfused.SGD8bit, mpfused.Lion8bit):
        kw = {"momentum": 0.9} if cls is mpfused.SGD8bit else {}
        with pytest.warns(UserWarning, match="percentile_clipping=5 is a legacy"):
            cls([p], percentile_clipping=5, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cls([p], args=None, min_8bit_size=4096, optim_bits=8, **kw)
        with pytest.raises(TypeError, match="unexpected keyword arguments"):
            cls([p], bogus=1, **kw)
        with pytest.raises(ValueError, match="block_size must be one of"):
            cls([p], block_size=100, **kw)
        assert cls is getattr(mpfused.optim, cls.__name__) and cls.__name__ in mpfused.__all__
    model = torch.nn.Linear(100, 64)
    model, opt, _ = mpfused.amp.setup(model, optimizer="sgd8bit", momentum=0.9, lr=0.1)
    assert type(opt) is mpfused.SGD8bit
    assert type(mpfused.amp.setup(torch.nn.Linear(100, 64), optimizer="lion8bit")[1]) \
        is mpfused.Lion8bit
