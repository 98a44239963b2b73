"""mpfused.SGD4bit / mpfused.Lion4bit (the momentum buffer / Lion's moment in torchao's 4-bit format
of AdamW4bit's first moment): trajectories against fp32 SGD / Lion (gap below), save / load /
continue bit-exact, checkpoints do not cross code widths, torch / fp32 cross-loads, the scaler
skip, the min size split, gradient release = the ordinary step, arguments and bytes per param.

Measured (CPU, seed 0, the settings of the tests below; asserted with margin):
* quadratic 0.5|w|^2, 64 x 128 weights from loss 4111: SGD (lr 1e-2, momentum 0.9) after 100
  steps fp32 0.029, 8-bit 0.024, 4-bit 1.09; after 200 steps fp32 7.6e-8, 4-bit 1.1e-3 (the
  deviation from the fp32 trajectory relative to the distance travelled: 0.017 at 100 steps,
  8-bit 0.0013). Lion (lr 1e-3) after 200 steps: fp32 2960, 8-bit 2965, 4-bit 2965 (relative
  deviation 0.18, 8-bit 0.18: Lion's sign steps amplify any difference alike).
* random N(0, 1) grads, 30 steps: relative deviation from the fp32 trajectory 0.26 (SGD; 8-bit
  0.019) and 0.29 (Lion; 8-bit 0.057), seeds 0-2: per-step noise of the 16-level state, as
  AdamW4bit's 0.26 (tests/test_adamw4bit.py).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

import mpfused
from mpfused import quant4 as q4
from mpfused.ops import OPS
from tests import test_release

SHAPES = ((64, 100), (5001,), (300,))  # 4-bit (50 blocks), 4-bit (odd, short last block), fp32
CASES = {
    "sgd": dict(cls=mpfused.SGD4bit, cls8=mpfused.SGD8bit, fp32=torch.optim.SGD,
                key="momentum_buffer", op="sgd4bit_step_",
                kw=dict(lr=0.01, momentum=0.9, weight_decay=1e-2)),
    "lion": dict(cls=mpfused.Lion4bit, cls8=mpfused.Lion8bit, fp32=mpfused.Lion, key="exp_avg",
                 op="lion4bit_step_", kw=dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}
# (param dtype, master_weights): every master mode
MASTER_CASES = [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"),
                (torch.bfloat16, "none"), (torch.bfloat16, "remainder8"), (torch.float16, "fp32")]
MASTER_IDS = [f"{str(d)[6:]}-{m}" for d, m in MASTER_CASES]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _set_grads(gen, *param_lists):
    for ps in zip(*param_lists):
        g = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = g.to(p.dtype)


def _decoded(st, key, shape):
    return q4.dequantize4_blockwise(st[key], st[key + "_absmax"], q4.signed4_map(), 128, shape)


# ---- trajectories --------------------------------------------------------------------------------
def _quadratic(cls, steps, **kw):
    torch.manual_seed(0)
    w0 = torch.randn(64, 128)
    p = torch.nn.Parameter(w0.clone())
    opt = cls([p], **kw)
    for _ in range(steps):
        p.grad = p.detach().clone()
        opt.step()
    return p.detach(), w0


def _loss(x):
    return 0.5 * (x ** 2).sum().item()


def test_sgd_trajectory_against_fp32_sgd():
    kw = dict(lr=1e-2, momentum=0.9)
    p4, w0 = _quadratic(mpfused.SGD4bit, 100, **kw)
    p32, _ = _quadratic(torch.optim.SGD, 100, **kw)
    assert _loss(p32) < 0.05 and _loss(p4) < 5, (_loss(p4), _loss(p32))  # 1.09 / 0.029 of 4111
    assert ((p4 - p32).norm() / (p32 - w0).norm()).item() < 0.05  # 0.017
    p4, _ = _quadratic(mpfused.SGD4bit, 200, **kw)
    assert _loss(p4) < 1e-2  # 1.1e-3 (fp32: 7.6e-8)


def test_lion_trajectory_against_fp32_lion():
    kw = dict(lr=1e-3, betas=(0.9, 0.99))
    p4, w0 = _quadratic(mpfused.Lion4bit, 200, **kw)
    p32, _ = _quadratic(mpfused.Lion, 200, **kw)
    assert abs(_loss(p4) - _loss(p32)) < 0.01 * _loss(p32)  # 2965 vs 2960 (from 4111)
    assert ((p4 - p32).norm() / (p32 - w0).norm()).item() < 0.25  # 0.18 (8-bit: 0.18)


@pytest.mark.parametrize("name", CASES)
def test_random_grads_deviation_is_bounded(name):
    case = CASES[name]
    kw = {k: v for k, v in case["kw"].items() if k != "weight_decay"}
    torch.manual_seed(0)
    w0 = torch.randn(64, 128)
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    o4, o32 = case["cls"]([p], **kw), case["fp32"]([q], **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        g = torch.randn(64, 128, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        o4.step(), o32.step()
    rel = ((p - q).norm() / (q - w0).norm()).item()
    assert rel < {"sgd": 0.35, "lion": 0.4}[name], rel  # 0.26 / 0.29


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,master", MASTER_CASES, ids=MASTER_IDS)
@pytest.mark.parametrize("name", CASES)
def test_save_load_continue_bit_exact(name, dtype, master):
    case = CASES[name]
    pa = _params(dtype)
    oa = case["cls"](pa, master_weights=master, **case["kw"])
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _set_grads(gen, pa)
        oa.step()
    st = oa.state[pa[1]]
    assert st[case["key"]].dtype == torch.uint8 and st[case["key"]].shape == ((5001 + 1) // 2,)
    assert oa.state[pa[2]][case["key"]].dtype == torch.float32  # below min_8bit_size
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["mpfused_8bit"]["bits"] == 4
    assert "state1" in saved["state"][0] and case["key"] not in saved["state"][0]
    pb = _clone(pa)
    ob = case["cls"](pb, master_weights=master, **case["kw"])
    ob.load_state_dict(saved)
    for _ in range(3):
        _set_grads(gen, pa, pb)
        oa.step()
        ob.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
        assert oa.state[a].keys() == ob.state[b].keys()
        for k, v in oa.state[a].items():
            assert torch.equal(v, ob.state[b][k]), k


@pytest.mark.parametrize("name", CASES)
def test_checkpoints_do_not_cross_code_widths(name):
    case = CASES[name]
    gen = torch.Generator().manual_seed(4)
    o4, o8 = case["cls"](_params(), **case["kw"]), case["cls8"](_params(), **case["kw"])
    for o in (o4, o8):
        _set_grads(gen, o.param_groups[0]["params"])
        o.step()
    with pytest.raises(ValueError, match="4-bit state"):
        case["cls8"](_params(), **case["kw"]).load_state_dict(o4.state_dict())
    with pytest.raises(ValueError, match="8-bit state"):
        case["cls"](_params(), **case["kw"]).load_state_dict(o8.state_dict())
    back = case["cls"](_params(), **case["kw"])  # through fp32 both ways works
    back.load_state_dict(o8.to_torch_state_dict())
    assert back.state[back.param_groups[0]["params"][0]][case["key"]].dtype == torch.uint8
    with pytest.raises(ValueError, match="4-bit state"):
        o4.to_bitsandbytes_state_dict()  # bitsandbytes has no 4-bit SGD / Lion


@pytest.mark.parametrize("name", CASES)
def test_torch_cross_load(name):
    """to_torch_state_dict() loads into the fp32 optimizer (torch.optim.SGD; mpfused.Lion) with the
    decoded state and both continue alike; the fp32 optimizer's state_dict loads quantized."""
    case = CASES[name]
    pa = _params()
    oa = case["cls"](pa, **case["kw"])
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        _set_grads(gen, pa)
        oa.step()
    pt = _clone(pa)
    ot = case["fp32"](pt, **case["kw"])
    ot.load_state_dict(oa.to_torch_state_dict())
    st = ot.state[pt[0]][case["key"]]
    assert st.dtype == torch.float32 and st.shape == SHAPES[0]
    assert torch.equal(st, _decoded(oa.state[pa[0]], case["key"], SHAPES[0]))
    _set_grads(gen, pa, pt)
    oa.step()
    ot.step()
    for a, t in zip(pa, pt):
        torch.testing.assert_close(a, t, rtol=2.4e-7, atol=1e-7)
    back = case["cls"](_clone(pt), **case["kw"])
    back.load_state_dict(ot.state_dict())
    sb = back.state[back.param_groups[0]["params"][0]]
    codes, absmax = q4.quantize4_blockwise(ot.state[pt[0]][case["key"]], q4.signed4_map(), 128)
    assert torch.equal(sb[case["key"]], codes) and torch.equal(sb[case["key"] + "_absmax"], absmax)


@pytest.mark.parametrize("name", CASES)
def test_scaler_skip_changes_nothing(name):
    case = CASES[name]
    params = _params(torch.bfloat16)
    opt = case["cls"](params, master_weights="remainder8", **case["kw"])
    scaler = mpfused.GradScaler("cpu", init_scale=2.0 ** 10)
    gen = torch.Generator().manual_seed(6)
    for s in range(3):
        _set_grads(gen, params)
        if s == 2:
            params[1].grad[3] = float("inf")
            before = ([p.detach().clone() for p in params],
                      copy.deepcopy(opt.state_dict()["state"]))
        scaler.scale(torch.zeros(()))
        scaler.step(opt)
        scaler.update()
    for a, b in zip(before[0], params):
        assert torch.equal(a.view(torch.uint8), b.detach().view(torch.uint8))
    after = opt.state_dict()["state"]
    for pid, st in before[1].items():
        for k, v in st.items():
            assert torch.equal(after[pid][k], v), k
    assert after[0]["step"].item() == 2.0


def test_min_size_split_and_group_rules():
    big, small = torch.nn.Parameter(torch.randn(4096)), torch.nn.Parameter(torch.randn(4095))
    opt = mpfused.SGD4bit([big, small], lr=0.01, momentum=0.9)
    ref = mpfused.SGD([torch.nn.Parameter(small.detach().clone())], lr=0.01, momentum=0.9)
    small.grad = ref.param_groups[0]["params"][0].grad = torch.randn(4095)
    big.grad = torch.randn(4096)
    opt.step(), ref.step()
    assert opt.state[big]["momentum_buffer"].shape == (2048,)
    assert torch.equal(opt.state[small]["momentum_buffer"],
                       ref.state[ref.param_groups[0]["params"][0]]["momentum_buffer"])
    assert torch.equal(small.detach(), ref.param_groups[0]["params"][0].detach())
    with pytest.raises(NotImplementedError, match="SGD4bit"):
        mpfused.SGD4bit([big], lr=0.01)
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="SGD4bit needs momentum"):
        opt.step()
    with pytest.raises(ValueError, match="block_size"):
        mpfused.Lion4bit([big], block_size=100)


def test_exports_and_setup():
    for cls in (mpfused.SGD4bit, mpfused.Lion4bit):
        assert cls is getattr(mpfused.optim, cls.__name__) and cls.__name__ in mpfused.__all__
    assert type(mpfused.amp.setup(torch.nn.Linear(100, 64), optimizer="sgd4bit", momentum=0.9,
                                  lr=0.1)[1]) is mpfused.SGD4bit
    assert type(mpfused.amp.setup(torch.nn.Linear(100, 64), optimizer="lion4bit")[1]) \
        is mpfused.Lion4bit


@pytest.mark.parametrize("name", CASES)
def test_bytes_per_param_and_estimate(name):
    case = CASES[name]
    big = torch.nn.Parameter(torch.randn(1024, 1024))
    opt = case["cls"]([big], **case["kw"])
    big.grad = torch.randn_like(big)
    opt.step()
    st = opt.state[big]
    state_bytes = sum(v.numel() * v.element_size() for k, v in st.items() if k != "step")
    assert state_bytes / big.numel() == pytest.approx(0.5 + 4 / 128)
    est = mpfused.amp.estimate_memory(big.numel(), "8bit", state_bits=4, block_size=128,
                                      optimizer=name)
    assert est.optimizer_state == round(state_bytes)


# ---- gradient release (from the engine) ----------------------------------------------------------
RELEASE_CASES = {"SGD4bit-bf16-remainder": (mpfused.SGD4bit, torch.bfloat16,
                                            {"momentum": 0.9, "min_8bit_size": 512,
                                             "master_weights": "remainder"}),
                 "Lion4bit-bf16-remainder8": (mpfused.Lion4bit, torch.bfloat16,
                                              {"min_8bit_size": 512,
                                               "master_weights": "remainder8"})}


@pytest.mark.parametrize("case", list(RELEASE_CASES))
def test_release_equals_ordinary_step(case, monkeypatch):
    """tests/test_release.py's check (accumulation, an LR schedule, a resume in the middle)."""
    monkeypatch.setitem(test_release.CASES, case, RELEASE_CASES[case])
    op = "sgd4bit_step_" if case.startswith("SGD") else "lion4bit_step_"
    native = OPS[op].native_available("cpu")
    steps = 20 if native else 6
    ordinary = test_release._train(case, False, None, steps, resume_at=steps // 2)
    released = test_release._train(case, True, None, steps, resume_at=steps // 2)
    test_release._assert_identical(ordinary, released)


@pytest.mark.parametrize("cls", ["AdamW8bit", "Adam8bit", "SGD8bit", "Lion8bit", "AdamW4bit",
                                 "Adam4bit", "SGD4bit", "Lion4bit"])
def test_block_size_default_is_stated_once(cls):
    """Every 8-bit and 4-bit class defaults to block_size=None: the width's blocks, stated once
    (quant_maps.DEFAULT_BLOCK_SIZE: bitsandbytes' 256, torchao's 4-bit 128)."""
    import inspect

    from mpfused.quant_maps import BLOCK_SIZES, DEFAULT_BLOCK_SIZE
    klass = getattr(mpfused, cls)
    init = next(c.__init__ for c in klass.__mro__ if "block_size" in
                inspect.signature(c.__init__).parameters)
    assert inspect.signature(init).parameters["block_size"].default is None
    kw = dict(lr=0.01, momentum=0.9) if cls.startswith("SGD") else {}
    opt = klass([torch.nn.Parameter(torch.zeros(8))], **kw)
    assert opt.param_groups[0]["block_size"] == DEFAULT_BLOCK_SIZE[klass._STATE_BITS]
    assert set(DEFAULT_BLOCK_SIZE.values()) <= set(BLOCK_SIZES)
    # estimate_memory's default is the width's too (block_size=None -> DEFAULT_BLOCK_SIZE)
    est = inspect.signature(mpfused.amp.estimate_memory).parameters["block_size"].default
    assert est is None
    bits = klass._STATE_BITS
    assert (mpfused.amp.estimate_memory(10**6, "8bit", state_bits=bits)
            == mpfused.amp.estimate_memory(10**6, "8bit", state_bits=bits,
                                           block_size=DEFAULT_BLOCK_SIZE[bits]))


@pytest.mark.parametrize("cls", ["AdamW8bit", "Adam8bit", "SGD8bit", "Lion8bit", "AdamW4bit",
                                 "Adam4bit", "SGD4bit", "Lion4bit"])
def test_checkpoint_without_its_block_size_loads_in_the_widths_blocks(cls):
    """A checkpoint that lost its block size (no "mpfused_8bit" entry, param groups without
    block_size: what a checkpointer keeping only torch's keys writes) is read in the width's
    default blocks (quant_maps.DEFAULT_BLOCK_SIZE: bitsandbytes' 256, torchao's 4-bit 128), not
    in 256-element blocks whatever the width: it loads and continues bit for bit."""
    from mpfused.quant_maps import DEFAULT_BLOCK_SIZE
    klass = getattr(mpfused, cls)
    block = DEFAULT_BLOCK_SIZE[klass._STATE_BITS]
    kw = dict(lr=0.01, momentum=0.9) if cls.startswith("SGD") else dict(lr=1e-3)
    pa = _params()
    oa = klass(pa, **kw)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        _set_grads(gen, pa)
        oa.step()
    saved = oa.state_dict()
    assert saved["param_groups"][0]["block_size"] == block
    saved.pop("mpfused_8bit")
    saved["param_groups"] = [{k: v for k, v in g.items() if k != "block_size"}
                             for g in saved["param_groups"]]
    assert saved["state"][1]["absmax1"].numel() == -(-5001 // block)  # multi-block, odd length
    pb = _clone(pa)
    ob = klass(pb, **kw)
    ob.load_state_dict(saved)
    for a, b in zip(pa, pb):
        assert oa.state[a].keys() == ob.state[b].keys()
        for k, v in oa.state[a].items():
            assert torch.equal(v, ob.state[b][k]), k
    _set_grads(gen, pa, pb)
    oa.step()
    ob.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))


@pytest.mark.parametrize("cls", ["AdamW8bit", "SGD8bit", "AdamW4bit", "Lion4bit"])
def test_checkpoint_without_its_block_size_is_read_in_the_blocks_its_absmax_tells(cls):
    """Saved with another block size and without it: the absmax length tells the size, so the
    state loads into an optimizer of that block size, and one of the default size refuses it
    naming the size the checkpoint needs (not the default it would otherwise assume)."""
    from mpfused.quant_maps import DEFAULT_BLOCK_SIZE
    klass = getattr(mpfused, cls)
    block = DEFAULT_BLOCK_SIZE[klass._STATE_BITS] // 2
    kw = dict(lr=0.01, momentum=0.9) if cls.startswith("SGD") else dict(lr=1e-3)
    pa = _params()
    oa = klass(pa, block_size=block, **kw)
    _set_grads(torch.Generator().manual_seed(7), pa)
    oa.step()
    saved = oa.state_dict()
    saved.pop("mpfused_8bit")
    saved["param_groups"] = [{k: v for k, v in g.items() if k != "block_size"}
                             for g in saved["param_groups"]]
    ob = klass(_clone(pa), block_size=block, **kw)
    ob.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(pa, ob.param_groups[0]["params"]):
        for k, v in oa.state[a].items():
            assert torch.equal(v, ob.state[b][k]), k
    with pytest.raises(ValueError, match=rf"no block size saved; its absmax length tells\) "
                                         rf"block_size={block}, this optimizer uses "
                                         rf"block_size={2 * block}"):
        klass(_clone(pa), **kw).load_state_dict(copy.deepcopy(saved))
