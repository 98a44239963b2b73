"""adam_step_'s master modes, exactly (moved from tests/test_adam_kernels.py, whose harness and
tolerances these use): remainder split/join and its kernel round trip, NaN masters, remainder =
fp32 master, stochastic rounding bit for bit given the same fp32 value, and unbiased."""

import pytest
import torch

from mpfused.reference import adam as ref
from tests.test_adam_kernels import (BF16, F32, FP32_MASTER, REMAINDER, STOCHASTIC, clone_state,
                                     make_state, new_grads, step)

OP_UNDER_TEST = "adam_step_"


# ---- master modes: exactness --------------------------------------------------------------------
def test_remainder_split_join_exact():
    # join(split(x)) == x for every fp32 bit pattern but NaN (inf, subnormals, -0 included), and
    # the param is x rounded to nearest bf16 with ties away from zero.
    bits = torch.randint(-2**31, 2**31, (1 << 16,), dtype=torch.int64)
    special = torch.tensor([0, -2**31, 0x7F800000, -0x00800000, 0x7FC00000, 1, 0x00008000,
                            0x3F808000, -0x407F8000, 0x7F7FFFFF, 0x7F7F8000], dtype=torch.int64)
    x = torch.cat([bits, special]).to(torch.int32).view(F32)
    p, rem = ref.remainder_split(x)
    nan = torch.isnan(x)
    assert torch.equal(ref.remainder_join(p, rem).view(torch.int32)[~nan],
                       x.view(torch.int32)[~nan])
    # every NaN is stored as the canonical quiet NaN, never rounded into -0.0 / +0.0
    assert (p.view(torch.int16)[nan] == 0x7FC0).all() and (rem[nan] == 0).all()
    finite = torch.isfinite(x) & (x.abs() < 3.3e38)
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF
    mag = (u & 0x7FFFFFFF).double()
    hi_mag = (((u >> 16) & 0x7FFF) << 16).double()
    round_up = lo >= 0x8000  # ties (0x8000) away from zero
    expect_mag = torch.where(round_up, hi_mag + 65536, hi_mag)
    got_mag = ((p.view(torch.int16).to(torch.int64) & 0x7FFF) << 16).double()
    assert torch.equal(got_mag[finite], expect_mag[finite])
    assert (mag[finite] - got_mag[finite]).abs().max() <= 32768


def test_remainder_kernel_roundtrip_exact(device, backend):
    # lr = 0, zero grads and moments: w = join(p, rem) is unchanged by the update, so the kernel's
    # join + split must give back the same (param, remainder) bits.
    n = 3000
    hi = torch.randint(-2**15, 2**15, (n,), dtype=torch.int32)
    lo = torch.randint(0, 2**16, (n,), dtype=torch.int32)
    w = ((hi << 16) | lo).view(F32)
    w = w[torch.isfinite(w) & (w != 0)].to(device)
    p, rem = ref.remainder_split(w)
    s = {"params": [p.clone()], "grads": [torch.zeros_like(p)], "exp_avgs": [torch.zeros_like(w)],
         "exp_avg_sqs": [torch.zeros_like(w)], "max_exp_avg_sqs": [], "masters": [rem.clone()],
         "steps": [torch.tensor(7.0, device=device)]}
    step(s, backend, lr=0.0, weight_decay=0.0, master_mode=REMAINDER)
    assert torch.equal(s["params"][0].view(torch.int16), p.view(torch.int16))
    assert torch.equal(s["masters"][0], rem)


def test_remainder_nan_stays_nan(device, backend):
    # A NaN master: GPU arithmetic's canonical NaN 0x7FFFFFFF (param 0x8000 + remainder -1 hold
    # it), x86's 0xFFC00000, a signaling NaN. Rounding 0x7FFFFFFF's high half up would give a
    # -0.0 param; every backend must store the canonical quiet NaN.
    p = torch.tensor([-0x8000, -0x0040, 0x7F80], dtype=torch.int16)  # 0x8000, 0xFFC0, 0x7F80
    rem = torch.tensor([-1, 0, 1], dtype=torch.int16)
    assert torch.isnan(ref.remainder_join(p.view(BF16), rem)).all()
    p = p.view(BF16).to(device)
    w = torch.zeros(3, device=device)
    s = {"params": [p.clone()], "grads": [torch.zeros_like(p)], "exp_avgs": [w.clone()],
         "exp_avg_sqs": [w.clone()], "max_exp_avg_sqs": [], "masters": [rem.to(device)],
         "steps": [torch.tensor(3.0, device=device)]}
    step(s, backend, lr=0.0, weight_decay=0.0, master_mode=REMAINDER)
    assert s["params"][0].view(torch.int16).tolist() == [0x7FC0] * 3
    assert s["masters"][0].tolist() == [0, 0, 0]


def test_remainder_equals_fp32_master(device, backend):
    # The remainder is an exact fp32 master: from the same fp32 start, modes 1 and 2 keep
    # bit-identical fp32 values and moments; params differ only at ties (lo16 == 0x8000).
    shapes = [(4097,), (0,), (7,)]
    a = make_state(shapes, BF16, REMAINDER, True, device)
    b = clone_state(a)
    b["masters"] = [ref.remainder_join(p, r) for p, r in zip(a["params"], a["masters"])]
    for _ in range(3):
        new_grads(a, 1.0)
        b["grads"] = [g.clone() for g in a["grads"]]
        step(a, backend, master_mode=REMAINDER, amsgrad=True)
        step(b, backend, master_mode=FP32_MASTER, amsgrad=True)
    for k in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"):
        for x, y in zip(a[k], b[k]):
            assert torch.equal(x, y)
    for pa, ra, pb, mb in zip(a["params"], a["masters"], b["params"], b["masters"]):
        joined = ref.remainder_join(pa, ra)
        assert torch.equal(joined.view(torch.int32), mb.view(torch.int32))
        tie = (mb.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(pa[~tie].view(torch.int16), pb[~tie].view(torch.int16))


# ---- stochastic rounding ------------------------------------------------------------------------
def _sr_expected(w32, seed, t, stream):
    idx = torch.arange(w32.numel(), device=w32.device).reshape(w32.shape)
    return ref.bf16_stochastic(w32.contiguous(), ref.random16(ref.step_seed(seed, t), stream, idx))


@pytest.mark.parametrize("keys", ["positions", "ids"])
@pytest.mark.parametrize("seed", [0, 0x5DEECE66D, -(2**62) - 12345])  # int64 (schema)
def test_stochastic_bit_exact(device, backend, seed, keys):
    # Given the same fp32 value w (the backend's own fp32-master run from identical inputs), the
    # stochastic result is exactly reference.bf16_stochastic(w, random16(step_seed(seed, t),
    # sr_stream(param_id, elem_offset), logical index)); without param_ids / elem_offsets the
    # id is the tensor's position in the call (empty tensors counted) and the offset 0.
    shapes = [(0,), (4097,), (1,), (0,), (6, 7), (7,)]
    s = make_state(shapes, BF16, STOCHASTIC, False, device, steps=[3, 0, 5, 1, 2, 8])
    s["params"][4] = s["params"][4].t().contiguous().t()  # staged (state is row-major)
    m = clone_state(s)
    m["masters"] = [p.float() for p in s["params"]]
    ids = [10 * i + 3 for i in range(len(shapes))] if keys == "ids" else []
    offsets = [17 * i for i in range(len(shapes))] if keys == "ids" else []
    kw = dict(seed=seed, param_ids=ids, elem_offsets=offsets)
    step(s, backend, master_mode=STOCHASTIC, **kw)
    step(m, backend, master_mode=FP32_MASTER, **kw)
    for i, p in enumerate(s["params"]):
        assert torch.equal(s["exp_avgs"][i], m["exp_avgs"][i])  # the same fp32 path
        if p.numel() == 0:
            continue
        t = s["steps"][i].item()
        stream = ref.sr_stream(ids[i], offsets[i]) if ids else ref.sr_stream(i)
        expect = _sr_expected(m["masters"][i], seed, t, stream)
        assert torch.equal(p.view(torch.int16), expect.view(torch.int16)), f"tensor {i}"


def test_stochastic_unbiased(device, backend):
    # 8 rows of 2048 identical elements: each element draws its own random bits, so the row mean
    # estimates E[round(w)] (= w when unbiased) with std <= 0.5 ulp / sqrt(2048) ~ 0.011 ulp.
    rows, n = 8, 2048
    p0 = (torch.randn(rows, 1) * 4).to(BF16).expand(rows, n).contiguous().to(device)
    g0 = torch.randn(rows, 1).to(BF16).expand(rows, n).contiguous().to(device)
    s = {"params": [p0.clone()], "grads": [g0], "exp_avgs": [torch.zeros(rows, n, device=device)],
         "exp_avg_sqs": [torch.zeros(rows, n, device=device)], "max_exp_avg_sqs": [],
         "masters": [], "steps": [torch.tensor(0.0, device=device)]}
    m = clone_state(s)
    m["masters"] = [p0.float()]
    kw = dict(lr=3e-3, weight_decay=0.0, seed=1234)
    step(s, backend, master_mode=STOCHASTIC, **kw)
    step(m, backend, master_mode=FP32_MASTER, **kw)
    w = m["masters"][0].double()
    out = s["params"][0].double()
    lo = ref.bf16_stochastic(m["masters"][0], torch.zeros_like(w, dtype=torch.int64)).double()
    ulp = (ref.bf16_stochastic(m["masters"][0], torch.full_like(w, 0xFFFF, dtype=torch.int64))
           .double() - lo).abs()
    assert ((out == lo) | ((out - lo).abs() == ulp)).all()  # only the two neighbours
    err = ((out.mean(1) - w[:, 0]).abs() / ulp[:, 0].clamp_min(1e-30))
    frac = ((w[:, 0] - lo[:, 0]).abs() / ulp[:, 0].clamp_min(1e-30))
    assert (err < 0.06).all(), (err, frac)
    # fresh draws every step: step 2 rounds the same value with other bits
    s2 = clone_state(s)
    s2["params"] = [p0.clone()]
    s2["steps"] = [torch.tensor(1.0, device=device)]
    step(s2, backend, master_mode=STOCHASTIC, **kw)
    moved = ulp[:, 0] > 0
    assert not torch.equal(s2["params"][0][moved], s["params"][0][moved])
