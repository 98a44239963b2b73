"""The one harness of the block-wise SGD / Lion ops: sgd8bit_step_ / lion8bit_step_ (one 8-bit
state in bitsandbytes' layout, signed dynamic map with its sign rule) and sgd4bit_step_ /
lion4bit_step_ (one 4-bit state, torchao's AdamW4bit m format: 16-entry signed map, two codes per
byte, no sign rule), on every (device, backend) pair against their float64 references
(mpfused/reference/{sgd,lion}{8,4}bit.py). It extends the 32-bit ops' harness
(tests/test_sgd_lion_kernels.py: params, masters, step counts, loss scale and clipping) with the
quantized state; the named cases are tests/sgd_lion_quant_cases.py's.

Each step is compared from identical inputs (the reference runs on a copy of the kernel's state
before the step), so errors never accumulate. What must agree and how closely (EPS = fp32
epsilon, T = |grad * mult| + |old state| (+ wd |w|) per element, Tb its maximum over the element's
block; the kernel updates in fp32, the reference in float64 rounded once):
* step counters: exact.
* absmax: |kernel - reference| <= 16 EPS Tb, and within OP_TOL[fp32] (a one-element block can
  cancel: rtol alone is not enough), and within rtol 1e-6 + ABSMAX_TOL_OF_TERMS of the tensor's
  terms (max |old| + max |g mult| + wd max |w|).
* codes: equal except one code apart where the state lies within those roundings of a decision
  point. 8-bit: the reference's x = s * (1 / absmax) lies within 16 EPS Tb / absmax of the
  threshold between the two codes (or of 0 for the sign rule's 126 / 127), at most
  max(2, n / 10,000) such codes per tensor and max(2, 0.5%) per call (measured: 9 in 105 calls of
  71,258 elements; 3 in a 70,001-element tensor in 3% of the draws of one case); 4-bit: at
  most max(1, 1%) of a tensor's codes, and an odd-sized tensor's padding nibble stays 0.
* params: OP_TOL of their dtype (1 ulp of a 16-bit param), and within 2e-6 rel + 1e-8 (fp32) /
  one epsilon of max(|p|, 1e-3) (16-bit); for Lion, except where the reference's interpolation
  c = b1 m + (1 - b1) g is within 16 EPS (|m| + |g|) of 0 (sign(c) is then a rounding decision);
  stochastic rounding: >= 99% of the elements bit-identical; fp32 masters and joined remainders
  rtol 1e-6, atol 1e-8; remainder8 masters REMAINDER8_TOL.
"""
import contextlib
import random

import pytest
import torch

import mpfused.reference.adam8bit as adam8bit_ref
import mpfused.reference.lion8bit as lion8_ref
import mpfused.reference.sgd8bit as sgd8_ref
from mpfused import quant4 as q4
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.reference import adam as ref
from tests import test_sgd_lion_kernels as SL
from tests.conftest import DEVICES
from tests.tolerances import ABSMAX_TOL_OF_TERMS, OP_TOL, REMAINDER8_TOL, assert_close

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NONE, FP32_MASTER, REMAINDER, STOCHASTIC, REMAINDER8 = 0, 1, 2, 3, 4
EPS = torch.finfo(torch.float32).eps
WIDTHS = (8, 4)
KINDS = ("sgd", "lion")
ALL_OPS = tuple(f"{k}{b}bit_step_" for b in WIDTHS for k in KINDS)
# hyperparameters in schema order, after (params, grads, codes, absmaxs, masters, steps, qmap)
HYPER = {
    "sgd": dict(block_size=64, lr=1e-2, lr_tensor=None, momentum=0.9, dampening=0.0,
                weight_decay=0.0, nesterov=False, maximize=False, master_mode=NONE),
    "lion": dict(block_size=64, lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.99,
                 weight_decay=0.0, maximize=False, master_mode=NONE),
}
KEYS = ("params", "grads", "codes", "absmaxs", "masters", "steps")
# every (device, backend) pair where one of the ops has the backend (the reference is the oracle)
DEV_BACKENDS = [pytest.param(d, b, id=f"{d}-{b}") for d in DEVICES for b in ("native", "triton")
                if any(b in OPS[op].available(d) for op in ALL_OPS)]
every_backend = pytest.mark.parametrize("dev,backend", DEV_BACKENDS)
every_width = pytest.mark.parametrize("bits", WIDTHS, ids=["8bit", "4bit"])


def op_name(kind, bits):
    return f"{kind}{bits}bit_step_"


def kind_bits(op):
    return ("sgd" if op.startswith("sgd") else "lion"), int(op.split("bit")[0][-1])


def require(op, dev, backend):
    """Skips where this op has no `backend` on `dev` (e.g. a build without its native kernel)."""
    if backend not in OPS[op].available(dev):
        pytest.skip(f"{op}: no {backend} backend on {dev}")


@contextlib.contextmanager
def one_intraop_thread():
    """torch on one intra-op thread for the test's own float64 work (reference, agreement check,
    state set-up): elementwise math and maxima, the same values on any thread count. On a loaded
    2-core machine each parallel region of it spins the second OpenMP thread while it waits to be
    scheduled: measured, the native kernels' named cases of both widths 19 s of CPU with 2
    threads, 2.8 s with this (the kernel itself still on the caller's threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ---- the codec of each width ------------------------------------------------------------------
def qmap_for(op, device="cpu"):
    return qm.signed_map(device) if kind_bits(op)[1] == 8 else q4.signed4_map(device)


def quantize(op, x, block):
    if kind_bits(op)[1] == 8:
        return qm.quantize_blockwise(x, qm.signed_map(x.device), block)
    return q4.quantize4_blockwise(x, q4.signed4_map(x.device), block)


def dequantize(op, codes, absmax, block, n):
    """The state as float64, flat (n elements)."""
    if kind_bits(op)[1] == 8:
        return qm.dequantize_blockwise(codes, absmax, qm.signed_map(codes.device),
                                       block).reshape(-1).double()
    return q4.dequantize4_blockwise(codes, absmax, q4.signed4_map(codes.device), block,
                                    (n,)).double()


def unpack(op, codes, n):
    """The codes as int64, one per element (flat)."""
    return codes.reshape(-1).long() if kind_bits(op)[1] == 8 else q4.unpack4(codes, n)


# ---- state ------------------------------------------------------------------------------------
@one_intraop_thread()
def make_state(shapes, dtypes, mode, device, block, steps=None, op="sgd8bit_step_", tiny=False):
    """Mid-training state: the 32-bit harness's params, grads, masters and step counts (0: SGD's
    first step takes the gradient as its buffer), random int8 corrections for remainder8, the
    quantized state from a random fp32 one (a random scale per tensor). tiny (8-bit): one element
    in 32 has a zero state and a tiny negative grad: its new state rounds to code 0 and the sign
    rule must store it one code below."""
    s32 = SL.make_state(shapes, dtypes, NONE if mode == REMAINDER8 else mode, device, steps)
    s = {k: s32[k] for k in ("params", "grads", "masters", "steps")}
    if mode == REMAINDER8:
        s["masters"] = [torch.randint(-128, 128, p.shape, dtype=torch.int8, device=device)
                        for p in s["params"]]
    if mode in (REMAINDER, REMAINDER8):  # (+0, a negative remainder) is no master (NaN bits)
        for p, m in zip(s["params"], s["masters"]):
            m[p == 0] = 0
    s["codes"], s["absmaxs"] = [], []
    for i, state in enumerate(s32["state"]):
        state = state * 10.0 ** random.randint(-4, 1)
        if tiny and kind_bits(op)[1] == 8:
            few = torch.rand(state.shape, device=device) < 1 / 32
            state[few] = 0.0
            s["grads"][i][few] = -1e-9
        c, a = quantize(op, state, block)
        s["codes"].append(c)
        s["absmaxs"].append(a)
    return s


def clone_state(s):
    return {k: [t.clone() for t in v] for k, v in s.items()}


def op_args(op, s, qmap=None, **kw):
    """(operands, keywords) of a call: HYPER and the 32-bit harness's TAIL, overridden by kw."""
    kind = kind_bits(op)[0]
    unknown = set(kw) - set(HYPER[kind]) - set(SL.TAIL)
    assert not unknown, f"{op}: no such keyword {sorted(unknown)}"
    h = {**HYPER[kind], **SL.TAIL, **kw}
    device = s["params"][0].device if s["params"] else "cpu"
    return ((s["params"], s["grads"], s["codes"], s["absmaxs"], s["masters"], s["steps"],
             qmap_for(op, device) if qmap is None else qmap),
            {k: h[k] for k in (*HYPER[kind], *SL.TAIL)})


def step(op, s, backend, **kw):
    """One call of `op` by keyword (qmap=: another map than the width's signed one)."""
    args, kwargs = op_args(op, s, **kw)
    OPS[op](*args, **kwargs, backend=backend)


def record_reference(monkeypatch):
    """The reference's float64 new states (before their fp32 rounding) and Lion's interpolations
    c, one entry per non-empty tensor in call order (cleared before each reference call). A test
    module makes it its fixture: `recorded = pytest.fixture(record_reference)`."""
    rec = {"state": [], "c": []}

    def store8(codes, absmax, state, *args, **kw):
        rec["state"].append(state.clone())
        return adam8bit_ref.store_quantized(codes, absmax, state, *args, **kw)

    def lion_update(w, g, m, lr, beta1, beta2, update=lion8_ref.lion_update):
        rec["c"].append(beta1 * m + (1 - beta1) * g)
        return update(w, g, m, lr, beta1, beta2)

    # the 4-bit references run the 8-bit loops (_bits=4): patching these records both widths
    for mod in (sgd8_ref, lion8_ref):
        monkeypatch.setattr(mod, "store_quantized", store8)
    monkeypatch.setattr(lion8_ref, "lion_update", lion_update)
    return rec


# ---- the agreement check ------------------------------------------------------------------------
def per_block_max(t, block):
    nb = -(-t.numel() // block)
    pad = torch.nn.functional.pad(t, (0, nb * block - t.numel()))
    return pad.view(nb, block).amax(1).repeat_interleave(block)[: t.numel()]


def _codes_close_8bit(i, got, want, x, tb, scale):
    """8-bit codes: one apart only where the reference's x is within rounding of the decision
    point between them; returns how many."""
    bad = got != want
    if not bad.any():
        return 0
    assert ((got - want).abs()[bad] == 1).all(), (i, "a code is off by more than one")
    assert int(bad.sum()) <= max(2, got.numel() / 10_000), (i, int(bad.sum()))
    lo = torch.minimum(got, want)
    dist = (x - qm.thresholds(qm.signed_map()).double()[lo]).abs()
    dist = torch.where(lo == qm.SIGNED_ZERO_CODE - 1, torch.minimum(dist, x.abs()), dist)
    assert (dist[bad] <= (16 * EPS * tb / scale)[bad]).all(), i
    return int(bad.sum())


def _params_close(kind, p0, pg, pr, old, g, c):
    """OP_TOL and the width-free relative bound, but for Lion's sign(c) near c = 0."""
    rtol, atol = OP_TOL[p0.dtype]
    close = (pg - pr).abs() <= atol + rtol * pr.abs()
    if p0.dtype == F32:
        close &= (pg - pr).abs() <= 2e-6 * pr.abs() + 1e-8
    else:  # a 16-bit param may round the other way at a tie of the fp32 value
        close &= (pg - pr).abs() <= torch.finfo(p0.dtype).eps * pr.abs().clamp_min(1e-3)
    if kind == "lion":
        close |= c.abs() <= 16 * EPS * (old.abs() + g)
    return close


def assert_matches_reference(op, s0, got, exp, rec, kw):
    """got: the kernel's state after one step from s0, exp: the reference's from s0; kw: the
    call's keywords (hyperparameters, block_size, master_mode, scaling)."""
    kind, bits = kind_bits(op)
    h = {**HYPER[kind], **SL.TAIL, **kw}
    block, mode = h["block_size"], h["master_mode"]
    mult = abs(ref.grad_multiplier(h["grad_scale"], h["norm_sq"], h["max_grad_norm"]))
    explained = sr_total = sr_same = j = 0
    for i, p0 in enumerate(s0["params"]):
        n = p0.numel()
        assert got["steps"][i].item() == exp["steps"][i].item() == s0["steps"][i].item() + 1
        if n == 0:
            continue
        pg, pr = got["params"][i], exp["params"][i]
        assert pg.dtype == pr.dtype == p0.dtype and pg.shape == pr.shape == p0.shape
        old = dequantize(op, s0["codes"][i], s0["absmaxs"][i], block, n)
        g = s0["grads"][i].reshape(-1).double().abs() * mult
        t = g + old.abs() + h["weight_decay"] * p0.reshape(-1).double().abs()
        tb = per_block_max(t, block)
        a_got, a_ref = got["absmaxs"][i], exp["absmaxs"][i]
        assert ((a_got.double() - a_ref.double()).abs() <= 16 * EPS * tb[::block]).all(), i
        assert_close(a_got, a_ref, dtype=F32)
        terms = float(old.abs().max() + g.max() + h["weight_decay"] * p0.abs().max())
        torch.testing.assert_close(a_got, a_ref, rtol=1e-6, atol=ABSMAX_TOL_OF_TERMS * terms)
        assert got["codes"][i].dtype == exp["codes"][i].dtype == torch.uint8
        assert got["codes"][i].shape == exp["codes"][i].shape == s0["codes"][i].shape
        cg, cr = unpack(op, got["codes"][i], n), unpack(op, exp["codes"][i], n)
        if bits == 8:
            scale = a_ref.double().repeat_interleave(block)[:n]
            x = rec["state"][j].reshape(-1).float().double() * qm.inv_scale(scale).double()
            explained += _codes_close_8bit(i, cg, cr, x, tb, scale)
        else:
            assert bool(((cg - cr).abs() <= 1).all()), i
            assert (cg != cr).sum().item() <= max(1, 0.01 * n), i
            if n % 2:  # the padding nibble of an odd-sized tensor stays 0
                assert int(got["codes"][i].reshape(-1)[-1]) & 0xF == 0
        c = rec["c"][j].reshape(-1) if kind == "lion" else None
        close = _params_close(kind, p0, pg.reshape(-1).double(), pr.reshape(-1).double(), old,
                              g, c)
        assert bool(close.all()), (i, int((~close).sum()))
        km = ref.kernel_mode(p0, mode)
        if km == FP32_MASTER:
            torch.testing.assert_close(got["masters"][i], exp["masters"][i], rtol=1e-6, atol=1e-8)
        elif km == REMAINDER:
            torch.testing.assert_close(ref.remainder_join(pg, got["masters"][i]),
                                       ref.remainder_join(pr, exp["masters"][i]),
                                       rtol=1e-6, atol=1e-8)
        elif km == REMAINDER8:
            torch.testing.assert_close(ref.remainder8_join(pg, got["masters"][i]),
                                       ref.remainder8_join(pr, exp["masters"][i]),
                                       **REMAINDER8_TOL)
        elif km == STOCHASTIC:
            sr_total += n
            sr_same += int((pg.view(torch.int16) == pr.view(torch.int16)).sum())
        j += 1
    total = sum(p.numel() for p in s0["params"])
    assert explained <= max(2, 0.005 * total), explained
    if sr_total:
        assert sr_same >= 0.99 * sr_total, f"stochastic rounding: {sr_same}/{sr_total} bit-equal"


def step_and_compare(op, s, backend, rec, **kw):
    """One step of `backend` on s, compared with the reference's from the same inputs. Only the
    kernel under test runs on the caller's thread count (natively: its parallel split)."""
    with one_intraop_thread():
        s0, expect = clone_state(s), clone_state(s)
        rec["state"].clear()
        rec["c"].clear()
        step(op, expect, "reference", **kw)
    step(op, s, backend, **kw)
    with one_intraop_thread():
        assert_matches_reference(op, s0, s, expect, rec, kw)


def scaling(s, scale, clip, fixed=False):
    """The call's scaling keywords: fixed, unscale by 2 and clip (norm 4, max 1: mult = 1/8, as
    fp32); else the 32-bit harness's (scale: the grads' loss scale; clip: max_grad_norm as a
    multiple of the unscaled grad norm)."""
    if fixed:
        dev = s["params"][0].device
        return dict(grad_scale=torch.tensor(2.0, device=dev), found_inf=torch.zeros((), device=dev),
                    norm_sq=torch.tensor(16.0, device=dev), max_grad_norm=1.0)
    return SL.scaler_args(s, scale, clip)


def run_steps(op, s, backend, rec, nsteps=3, scale=None, clip=None, fixed=False, fresh=True,
              **kw):
    """nsteps steps, each compared with the reference; fresh: new grads before each (else the
    state's grads for the first)."""
    for k in range(nsteps):
        with one_intraop_thread():
            if fresh or k:
                SL.new_grads(s, scale or 1.0)
            scaled = scaling(s, scale, clip, fixed)
        step_and_compare(op, s, backend, rec, **kw, **scaled)
