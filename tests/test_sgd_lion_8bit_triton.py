"""sgd8bit_step_ and lion8bit_step_ on the Triton backend (interpreter on CPU; compiled where a GPU
is) against the float64 references (mpfused/reference/sgd8bit.py, lion8bit.py).

Each step is compared from identical inputs (the reference runs on a copy of the kernel's state
before the step), so errors never accumulate:
* params, masters, remainders, stochastic rounding: as tests/test_sgd_lion_kernels.py (OP_TOL;
  1 ulp of a 16-bit param; >= 99% of stochastically rounded elements bit-identical).
* absmax: the kernel's fp32 state differs from the reference's float64 state rounded to fp32 by
  a few fp32 roundings of the update's terms (grads ~1), so the block maxima agree within
  OP_TOL[fp32] as the 32-bit states do (a one-element block can cancel: rtol alone is not enough).
* codes: equal except where the state lies within those roundings of a decision threshold (or its
  absmax moved by an ulp): such a code is off by one, and rare (none in 537k elements of these
  cases over 6 seeds; at most 2 per tensor allowed, as tests/test_adam8bit_kernels.py).
* step counters: exact. The first SGD step, the sign rule, a skipped step and NaN are checked
  exactly.
"""
import random

import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import OPS
from tests import test_sgd_lion_kernels as SL
from tests.conftest import DEVICES
from tests.tolerances import assert_close

pytestmark = pytest.mark.skipif("triton" not in OPS["sgd8bit_step_"].available("cpu"),
                                reason="no Triton (or TRITON_INTERPRET unset)")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NONE, FP32_MASTER, REMAINDER, STOCHASTIC = 0, 1, 2, 3
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
# hyperparameters in schema order, after (params, grads, codes, absmaxs, masters, steps, qmap)
HYPER = {
    "sgd8bit_step_": dict(block_size=64, lr=1e-2, lr_tensor=None, momentum=0.9, dampening=0.0,
                          weight_decay=0.0, nesterov=False, maximize=False, master_mode=NONE),
    "lion8bit_step_": dict(block_size=64, lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.99,
                           weight_decay=0.0, maximize=False, master_mode=NONE),
}
KEYS = ("params", "grads", "codes", "absmaxs", "masters", "steps")


def shapes_for(block):
    """Odd sizes, empties, a 2-d tensor, and several blocks with a partial last one."""
    return [(1,), (0,), (7,), (2 * block + block // 2 + 3,), (2, 0), (5, 13)]


# ---- state ------------------------------------------------------------------------------------
def make_state(shapes, dtypes, mode, device, block, steps=None):
    """Mid-training state: the 32-bit tests' params, masters and step counts (0: SGD's first
    step), the 8-bit state quantized from a random fp32 one (blocks of different scales)."""
    s32 = SL.make_state(shapes, dtypes, mode, device, steps)
    s = {k: s32[k] for k in ("params", "grads", "masters", "steps")}
    s["codes"], s["absmaxs"] = [], []
    for state in s32["state"]:
        state = state * 10.0 ** random.randint(-4, 1)
        c, a = qm.quantize_blockwise(state, qm.signed_map(device), block)
        s["codes"].append(c)
        s["absmaxs"].append(a)
    return s


def op_args(op, s, **kw):
    h = {**HYPER[op], **SL.TAIL, **kw}
    return ((s["params"], s["grads"], s["codes"], s["absmaxs"], s["masters"], s["steps"],
             qm.signed_map(s["params"][0].device)),
            {k: h[k] for k in (*HYPER[op], *SL.TAIL)})


def step(op, s, backend, **kw):
    args, kwargs = op_args(op, s, **kw)
    OPS[op](*args, **kwargs, backend=backend)


# ---- comparison -------------------------------------------------------------------------------
def assert_codes_close(got, want):
    diff = (got.int() - want.int()).abs()
    assert not (diff > 1).any(), "a code is off by more than one"
    assert int((diff > 0).sum()) <= 2


def assert_state_close(s, e, mode):
    """s: the kernel's state after one step, e: the reference's from the same inputs."""
    for a, b in zip(s["absmaxs"], e["absmaxs"]):
        assert_close(a, b, dtype=F32)
    for a, b in zip(s["codes"], e["codes"]):
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
        assert_codes_close(a, b)
    SL.assert_state_close({**s, "state": []}, {**e, "state": []}, mode)  # params, masters, steps


def run_steps(op, s, nsteps=3, scale=None, clip=None, **kw):
    for _ in range(nsteps):
        SL.new_grads(s, scale or 1.0)
        extra = SL.scaler_args(s, scale, clip)
        expect = SL.clone_state(s)
        step(op, expect, "reference", **kw, **extra)
        step(op, s, "triton", **kw, **extra)
        assert_state_close(s, expect, kw.get("master_mode", NONE))


# ---- cases: (dtypes, master mode, options); options: the op's kwargs (block_size included) plus
# lr_tensor (bool), scale (the grads' loss scale: grad_scale + found_inf) and clip (see
# SL.scaler_args). SGD8bit always has momentum (> 0: the buffer is its only state).
MIXED = SL.MIXED
SGD_CASES = [
    (F32, NONE, dict()),
    (F32, NONE, dict(dampening=0.1, weight_decay=0.1, block_size=256)),
    (F32, NONE, dict(nesterov=True, maximize=True, lr_tensor=True, scale=1024.0, clip=0.5)),
    (F32, NONE, dict(momentum=0.5, weight_decay=0.1, maximize=True, scale=65536.0,
                     block_size=4096)),
    (F16, NONE, dict(weight_decay=0.1, block_size=128)),
    (F16, FP32_MASTER, dict(nesterov=True, weight_decay=0.1, lr_tensor=True, scale=1024.0,
                            clip=0.5)),
    (BF16, NONE, dict(dampening=0.5, block_size=512)),
    (BF16, FP32_MASTER, dict(weight_decay=0.1, scale=8.0, clip=4.0)),  # clip inactive
    (BF16, REMAINDER, dict(nesterov=True, weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, REMAINDER, dict(maximize=True, lr_tensor=True, block_size=1024)),
    (BF16, STOCHASTIC, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, STOCHASTIC, dict(lr_tensor=True, seed=-(2**62) - 12345, block_size=2048)),
    (MIXED, FP32_MASTER, dict(nesterov=True, weight_decay=0.1, scale=1024.0, clip=0.5)),
    (MIXED, STOCHASTIC, dict(dampening=0.1, maximize=True, lr_tensor=True,
                             param_ids=[7, 3, 0, 12, 5, 1],
                             elem_offsets=[0, 4096, 64, 0, 1 << 40, 9])),
]
LION_CASES = [
    (F32, NONE, dict()),
    (F32, NONE, dict(weight_decay=0.1, maximize=True, lr_tensor=True, scale=1024.0, clip=0.5,
                     block_size=256)),
    (F32, NONE, dict(beta1=0.95, beta2=0.98, weight_decay=1.0, scale=65536.0, block_size=4096)),
    (F16, NONE, dict(weight_decay=0.1, block_size=128)),
    (F16, FP32_MASTER, dict(weight_decay=0.1, lr_tensor=True, scale=1024.0, clip=0.5)),
    (BF16, NONE, dict(maximize=True, block_size=512)),
    (BF16, FP32_MASTER, dict(weight_decay=0.1, scale=8.0, clip=4.0)),  # clip inactive
    (BF16, REMAINDER, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, REMAINDER, dict(maximize=True, lr_tensor=True, block_size=1024)),
    (BF16, STOCHASTIC, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (BF16, STOCHASTIC, dict(lr_tensor=True, seed=0x5DEECE66D, block_size=2048)),
    (MIXED, FP32_MASTER, dict(weight_decay=0.1, scale=1024.0, clip=0.5)),
    (MIXED, STOCHASTIC, dict(maximize=True, lr_tensor=True, param_ids=[7, 3, 0, 12, 5, 1],
                             elem_offsets=[0, 4096, 64, 0, 1 << 40, 9])),
]
CASES = [("sgd8bit_step_", c) for c in SGD_CASES] + [("lion8bit_step_", c) for c in LION_CASES]


def case_id(case):  # "sgd8bit-bfloat16-mode3-lr_tensor-block_size2048"...
    op, (dtypes, mode, opts) = case
    dts = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    names = "+".join(dict.fromkeys(str(d).replace("torch.", "") for d in dts))
    flags = [k if v is True or isinstance(v, list) else f"{k}{v}" for k, v in opts.items()]
    return "-".join([op.split("_")[0], names, f"mode{mode}"] + flags)


def case_state(op, case, device, steps=None):
    """(state, op kwargs, scale, clip) of a case."""
    dtypes, mode, opts = case
    block = opts.get("block_size", HYPER[op]["block_size"])
    s = make_state(shapes_for(block), list(dtypes) if isinstance(dtypes, tuple) else dtypes, mode,
                   device, block, steps)
    kw, scale, clip = SL.case_kwargs(op, opts, device)
    return s, dict(kw, master_mode=mode), scale, clip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(device, case):
    op, c = case
    s, kw, scale, clip = case_state(op, c, device)
    run_steps(op, s, scale=scale, clip=clip, **kw)


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_every_block_size(op, block, device="cpu"):
    # fp32 and bf16 + stochastic rounding, blocks of 64..4096 with partial last blocks
    s = make_state(shapes_for(block), [F32, BF16] * 3, STOCHASTIC, device, block)
    run_steps(op, s, nsteps=2, master_mode=STOCHASTIC, block_size=block, weight_decay=0.1)


# ---- exact behaviour --------------------------------------------------------------------------
def test_sgd_first_step_quantizes_the_gradient(device="cpu"):
    # step counter 0: the buffer becomes the (unscaled) grad, whatever the old codes held (a NaN
    # absmax here); its codes and absmax are exactly the codec's of that grad
    s = make_state([(200,), (200,)], F32, NONE, device, 64, steps=[0, 4])
    s["absmaxs"][0].fill_(float("nan"))
    g = [x.clone() for x in s["grads"]]
    step("sgd8bit_step_", s, "triton", dampening=0.25, grad_scale=torch.tensor(4.0))
    codes, absmax = qm.quantize_blockwise(g[0] / 4, qm.signed_map(), 64)
    assert torch.equal(s["codes"][0], codes) and torch.equal(s["absmaxs"][0], absmax)
    assert [t.item() for t in s["steps"]] == [1.0, 5.0]


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_sign_rule_keeps_negatives_below_zero(op, device="cpu"):
    # from a zero state, tiny negative grads in a block with a large one update to tiny negative
    # states whose nearest code is +0: they are stored one code below (bitsandbytes' rule); tiny
    # positive ones stay at +0
    zc = qm.zero_code(qm.signed_map())
    n = 64
    g = torch.zeros(n)
    g[0] = 1.0
    g[1:20] = -1e-12
    g[20:40] = 1e-12
    out = {}
    for backend in ("triton", "reference"):
        s = {"params": [torch.randn(n)], "grads": [g.clone()],
             "codes": [torch.full((n,), zc, dtype=torch.uint8)], "absmaxs": [torch.ones(1)],
             "masters": [], "steps": [torch.tensor(3.0)]}
        step(op, s, backend)
        out[backend] = s["codes"][0]
    assert (out["triton"][1:20] == zc - 1).all() and (out["triton"][20:64] == zc).all()
    assert torch.equal(out["triton"], out["reference"])


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_nan_gives_a_nan_absmax(op, device="cpu"):
    # a NaN grad makes its block's state NaN somewhere: the block's absmax is NaN (a max over the
    # bit patterns, not a float max that would skip it); the other blocks are untouched by it
    s = make_state([(3 * 64,)], F32, NONE, device, 64, steps=[3])
    s["grads"][0][64 + 5] = float("nan")
    expect = SL.clone_state(s)
    step(op, s, "triton")
    step(op, expect, "reference")
    a = s["absmaxs"][0]
    assert torch.isnan(a[1]) and not torch.isnan(a[[0, 2]]).any()
    assert_close(a[[0, 2]], expect["absmaxs"][0][[0, 2]], dtype=F32)
    assert torch.isnan(s["params"][0][64 + 5])
    for blk in (0, 2):
        sl = slice(64 * blk, 64 * blk + 64)
        assert_codes_close(s["codes"][0][sl], expect["codes"][0][sl])
        assert_close(s["params"][0][sl], expect["params"][0][sl])


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC],
                         ids=["master", "remainder", "stochastic"])
def test_skip_on_found_inf(op, mode, device="cpu"):
    s = make_state([(7,), (0,), (200,), (4, 5)], [F32, BF16, BF16, BF16], mode, device, 64,
                   steps=[0, 0, 3, 1])
    s["grads"][2][3] = float("inf")
    before = SL.clone_state(s)
    step(op, s, "triton", master_mode=mode, grad_scale=torch.tensor(8.0), found_inf=torch.ones(1),
         norm_sq=torch.tensor(float("inf")), max_grad_norm=1.0, lr_tensor=torch.tensor(1e-2))
    for k in KEYS:
        for x, y in zip(s[k], before[k]):
            assert SL.bits_equal(x, y), k
    # found_inf == 0: the step is taken and every counter advances (empty tensors' included)
    SL.new_grads(s, 8.0)
    step(op, s, "triton", master_mode=mode, grad_scale=torch.tensor(8.0),
         found_inf=torch.zeros(1))
    for x, y in zip(s["steps"], before["steps"]):
        assert x.item() == y.item() + 1
    assert not torch.equal(s["absmaxs"][2], before["absmaxs"][2])


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_no_host_sync(op, monkeypatch, device="cpu"):
    # Every scalar is read on device: no .item()/bool()/float() on a tensor.
    s = make_state([(70,), (0,), (5, 3)], BF16, STOCHASTIC, device, 64, steps=[0, 2, 5])
    kw = dict(master_mode=STOCHASTIC, lr_tensor=torch.tensor(1e-2),
              grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()),
              norm_sq=torch.tensor(2.0), max_grad_norm=1.0)
    expect = SL.clone_state(s)
    step(op, expect, "reference", **kw)
    qm.thresholds(qm.signed_map())  # the map's thresholds are cached host data, built once

    def boom(*a, **k):
        raise AssertionError("host sync in the Triton path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    try:
        step(op, s, "triton", **kw)
    finally:
        monkeypatch.undo()
    assert_state_close(s, expect, STOCHASTIC)


@pytest.mark.parametrize("op", ["sgd8bit_step_", "lion8bit_step_"])
def test_noncontiguous_param_and_grad(op, device="cpu"):
    # the block layout is the logical order: a transposed param / grad is staged and written back
    s = make_state([(9, 33)], BF16, FP32_MASTER, device, 64, steps=[4])
    s["params"][0] = s["params"][0].t().contiguous().t()
    s["masters"][0] = s["masters"][0].t().contiguous().t()
    p = s["params"][0]
    for _ in range(2):
        SL.new_grads(s, 1.0)
        s["grads"] = [g.t().contiguous().t() for g in s["grads"]]
        expect = SL.clone_state(s)
        step(op, expect, "reference", master_mode=FP32_MASTER, weight_decay=0.1)
        step(op, s, "triton", master_mode=FP32_MASTER, weight_decay=0.1)
        assert_state_close(s, expect, FP32_MASTER)
    assert s["params"][0] is p and not p.is_contiguous()


def test_argument_checks():
    s = make_state([(100,)], F32, NONE, "cpu", 64)
    before = SL.clone_state(s)
    with pytest.raises(RuntimeError, match="momentum must be > 0"):
        step("sgd8bit_step_", s, "triton", momentum=0.0)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        step("lion8bit_step_", s, "triton", block_size=96)
    with pytest.raises(RuntimeError, match=r"lion8bit_step_: exp_avgs has 0 tensors, expected 1"):
        step("lion8bit_step_", {**s, "codes": []}, "triton")
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[0\] must be contiguous uint8"):
        step("sgd8bit_step_", {**s, "codes": [s["codes"][0].float()]}, "triton")
    with pytest.raises(RuntimeError, match=r"absmaxs\[0\] must be contiguous float32 with "
                                           r"ceil\(numel / block_size\) = 1 entries"):
        step("sgd8bit_step_", s, "triton", block_size=128)  # absmaxs hold 2 blocks of 64
    with pytest.raises(RuntimeError, match=r"grads\[0\] must have its param's dtype"):
        step("lion8bit_step_", {**s, "grads": [s["grads"][0].half()]}, "triton")
    args, kwargs = op_args("lion8bit_step_", s)
    args = list(args)
    args[6] = qm.unsigned_map()  # no code below +0 for the sign rule
    with pytest.raises(RuntimeError, match=r"qmap must hold \+0.0 above its lowest entry"):
        OPS["lion8bit_step_"](*args, **kwargs, backend="triton")
    bf = make_state([(100,)], BF16, NONE, "cpu", 64)
    with pytest.raises(RuntimeError, match="needs one master per param"):
        step("lion8bit_step_", bf, "triton", master_mode=FP32_MASTER)
    for k in KEYS:  # a refused call writes nothing
        assert all(SL.bits_equal(x, y) for x, y in zip(s[k], before[k])), k
