"""Exact behaviour of the block-wise SGD / Lion ops (sgd8bit_step_ / lion8bit_step_,
sgd4bit_step_ / lion4bit_step_) on every (device, backend) pair, on the one harness
(tests/sgd_lion_quant_harness.py): SGD's first step quantizes the gradient; the 8-bit sign rule
(a negative state never stores +0) and the encoding (nearest code, the binary-search fallback of
a map the lookup table cannot encode); the 4-bit codec = AdamW4bit's m codec byte for byte; a NaN
grad poisons its block only, an inf one makes its block's absmax inf; non-contiguous params and
grads (the block layout is the logical order); no host synchronization."""
import pytest
import torch

from mpfused import quant4 as q4
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from tests.sgd_lion_quant_cases import DEFAULT_BLOCK
from tests import test_sgd_lion_kernels as SL
from tests.sgd_lion_quant_harness import (BF16, F32, FP32_MASTER, KEYS, KINDS, NONE, REMAINDER,
                                          STOCHASTIC, assert_matches_reference, clone_state,
                                          every_backend, every_width, make_state, op_name,
                                          quantize, record_reference, require, step,
                                          step_and_compare, unpack)
from tests.test_quant8 import _brute_nearest, _probe_values
from tests.tolerances import assert_close

recorded = pytest.fixture(record_reference)


def assert_codes_close(got, want, most=2):
    diff = (got.int() - want.int()).abs()
    assert not (diff > 1).any(), "a code is off by more than one"
    assert int((diff > 0).sum()) <= most


def raw(t):
    return t.reshape(-1).contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(
        torch.uint8)


# ---- first step, sign rule, encoding -------------------------------------------------------------
@every_backend
@every_width
def test_sgd_first_step_quantizes_the_gradient(dev, backend, bits):
    # step counter 0: the buffer becomes the (unscaled) grad, whatever the old codes held (a NaN
    # absmax here); its codes and absmax are exactly the codec's of that grad
    op = op_name("sgd", bits)
    require(op, dev, backend)
    s = make_state([(200,), (200,)], F32, NONE, dev, 64, steps=[0, 4], op=op)
    s["absmaxs"][0].fill_(float("nan"))
    g = [x.clone() for x in s["grads"]]
    step(op, s, backend, dampening=0.25, grad_scale=torch.tensor(4.0, device=dev))
    codes, absmax = quantize(op, g[0] / 4, 64)
    assert torch.equal(s["codes"][0], codes) and torch.equal(s["absmaxs"][0], absmax)
    assert [t.item() for t in s["steps"]] == [1.0, 5.0]


@every_backend
@pytest.mark.parametrize("kind", KINDS)
def test_sign_rule_keeps_negatives_below_zero(dev, backend, kind):
    # 8-bit: from a zero state, tiny negative grads in a block with a large one update to tiny
    # negative states whose nearest code is +0: they are stored one code below (bitsandbytes'
    # rule); tiny positive ones stay at +0
    op = op_name(kind, 8)
    require(op, dev, backend)
    zc = qm.zero_code(qm.signed_map())
    n = 64
    g = torch.zeros(n, device=dev)
    g[0] = 1.0
    g[1:20] = -1e-12
    g[20:40] = 1e-12
    out = {}
    for b in (backend, "reference"):
        s = {"params": [torch.randn(n, device=dev)], "grads": [g.clone()],
             "codes": [torch.full((n,), zc, dtype=torch.uint8, device=dev)],
             "absmaxs": [torch.ones(1, device=dev)], "masters": [],
             "steps": [torch.tensor(3.0, device=dev)]}
        step(op, s, b)
        out[b] = s["codes"][0].cpu()
    assert (out[backend][1:20] == zc - 1).all() and (out[backend][20:64] == zc).all()
    assert torch.equal(out[backend], out["reference"])


@every_backend
def test_encode_equals_brute_force_nearest_with_the_sign_rule(dev, backend):
    """Lion with beta2 = 0 stores m = g exactly: in blocks whose absmax is 1 the codes must be the
    nearest entries of g (ties down) with the sign rule (a negative value never stores 0)."""
    require("lion8bit_step_", dev, backend)
    s = qm.signed_map()
    x = _probe_values(s)
    x = torch.cat([x[x.abs() <= 1][: 255 * 60], -torch.rand(255 * 2) * 1e-7, torch.tensor([-0.0])])
    nb = -(-x.numel() // 255)
    x = torch.nn.functional.pad(x, (0, nb * 255 - x.numel()))
    g = torch.cat([torch.ones(nb, 1), x.view(nb, 255)], dim=1).reshape(-1)  # absmax 1 per block
    c = {"params": [torch.zeros_like(g)], "grads": [g], "codes": [torch.zeros_like(g).byte()],
         "absmaxs": [torch.zeros(nb)], "masters": [], "steps": [torch.zeros(())]}
    c = {k: [t.to(dev) for t in v] for k, v in c.items()}
    step("lion8bit_step_", c, backend, beta1=0.5, beta2=0.0, block_size=256)
    assert torch.equal(c["absmaxs"][0].cpu(), torch.ones(nb))
    want = _brute_nearest(g, s)
    want = torch.where(torch.signbit(g) & (want == qm.SIGNED_ZERO_CODE), want - 1, want)
    assert torch.equal(c["codes"][0].cpu().long(), want)
    assert int((c["codes"][0] == qm.SIGNED_ZERO_CODE - 1).sum()) >= 2 * 255  # the rule fired


@every_backend
@pytest.mark.parametrize("kind", KINDS)
def test_map_the_lut_cannot_encode_takes_the_binary_search(dev, backend, kind):
    """A signed map with entries closer than a bf16 bin: the LUT is not exact, the native kernel
    falls back to quant8_encode + quant8_keep_negative; same rules as the reference."""
    op = op_name(kind, 8)
    require(op, dev, backend)
    q = qm.signed_map().clone()
    q[200:210] = q[200] + torch.arange(10) * 2.0**-22  # ten entries in one bf16 bin
    assert bool((q[1:] > q[:-1]).all())
    c = make_state([(5000,), (77,)], F32, NONE, dev, 256, steps=[3, 3], op=op, tiny=True)
    for t in c["codes"]:  # states that land in the dense stretch too
        t[::3] = 205
    got, ref = clone_state(c), clone_state(c)
    step(op, got, backend, block_size=256, qmap=q.to(dev))
    step(op, ref, "reference", block_size=256, qmap=q.to(dev))
    for a, b in zip(got["codes"], ref["codes"]):
        assert (a.int() - b.int()).abs().max() <= 1 and (a != b).sum() <= 2
    for a, b in zip(got["absmaxs"], ref["absmaxs"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@every_backend
def test_codes_equal_adamw4bit_m_codec(dev, backend):
    """A state that is exactly g (SGD's first step; Lion with beta2 = 0; adam4bit_step_ from a zero
    state with beta1 = 0) is encoded as AdamW4bit's m codec (quant4.quantize4_blockwise with the
    signed map, as its QuantState) and as adam4bit_step_'s kernel encodes it: same bytes."""
    require("sgd4bit_step_", dev, backend)
    block = DEFAULT_BLOCK[4]
    n = 3 * 128 + 77 if backend == "triton" else 50_001
    g = (torch.randn(n) * torch.logspace(-6, 1, n)[torch.randperm(n)]).to(dev)
    want_codes, want_absmax = q4.quantize4_blockwise(g, q4.signed4_map(dev), block)
    for kind, hyper in (("sgd", {}), ("lion", dict(beta2=0.0))):
        c = make_state([(n,)], F32, NONE, dev, block, steps=[0], op=op_name(kind, 4))
        c["grads"] = [g.clone()]
        step(op_name(kind, 4), c, backend, block_size=block, **hyper)
        assert torch.equal(c["codes"][0], want_codes), kind
        assert torch.equal(c["absmaxs"][0], want_absmax), kind
    c1, a1 = q4.zero_codes4(n, True, dev), torch.zeros(-(-n // block), device=dev)
    c2, a2 = q4.zero_codes4(n, False, dev), torch.zeros(-(-n // block), device=dev)
    OPS["adam4bit_step_"]([torch.zeros(n, device=dev)], [g.clone()], [c1], [c2], [a1], [a2], [],
                          [torch.zeros((), device=dev)], q4.signed4_map(dev), q4.unsigned4_map(dev),
                          block_size=block, lr=1e-3, lr_tensor=None, beta1=0.0, beta2=0.999,
                          eps=1e-8, weight_decay=0.0, maximize=False, decoupled=True,
                          master_mode=0, backend=backend)
    assert torch.equal(c1, want_codes) and torch.equal(a1, want_absmax)


# ---- NaN and inf ---------------------------------------------------------------------------------
@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [64, None], ids=["b64", "bdefault"])
def test_nan_grad_poisons_its_block_only(dev, backend, bits, kind, block):
    # a NaN grad makes its block's state NaN somewhere: the block's absmax is NaN (a max over the
    # bit patterns, not a float max that would skip it); the other blocks are untouched by it
    op = op_name(kind, bits)
    require(op, dev, backend)
    block = block or DEFAULT_BLOCK[bits]
    n, bad = 4 * block, block + 44  # in block 1
    c = make_state([(n,)], F32, NONE, dev, block, steps=[3], op=op)
    c["grads"][0][bad] = float("nan")
    got, ref = clone_state(c), clone_state(c)
    step(op, got, backend, block_size=block)
    step(op, ref, "reference", block_size=block)
    assert got["absmaxs"][0].isnan().tolist() == [False, True, False, False]
    assert ref["absmaxs"][0].isnan().tolist() == [False, True, False, False]
    assert got["params"][0][bad].isnan()  # SGD: w - lr NaN; Lion: sign(NaN) is NaN, not 0
    keep = torch.ones(n, dtype=torch.bool, device=dev)
    keep[block:2 * block] = False  # elsewhere: the usual agreement
    assert_codes_close(unpack(op, got["codes"][0], n)[keep], unpack(op, ref["codes"][0], n)[keep])
    torch.testing.assert_close(got["absmaxs"][0][[0, 2, 3]], ref["absmaxs"][0][[0, 2, 3]],
                               rtol=1e-6, atol=0)
    assert_close(got["absmaxs"][0][[0, 2, 3]], ref["absmaxs"][0][[0, 2, 3]], dtype=F32)
    assert_close(got["params"][0][keep], ref["params"][0][keep])


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_inf_grad_gives_an_inf_absmax(dev, backend, bits, kind):
    """An inf state: its block's absmax is inf, x = s * (1 / inf) is 0 for the finite states and
    NaN (code 0) for the inf one, as the reference encodes it."""
    op = op_name(kind, bits)
    require(op, dev, backend)
    block = DEFAULT_BLOCK[bits]
    n, bad = 4 * block, block + 72
    c = make_state([(n,)], F32, NONE, dev, block, steps=[3], op=op)
    c["grads"][0][bad] = float("inf")  # block 1
    d, ref = clone_state(c), clone_state(c)
    step(op, d, backend, block_size=block)
    step(op, ref, "reference", block_size=block)
    assert d["absmaxs"][0][1].item() == float("inf") == ref["absmaxs"][0][1].item()
    got, want = unpack(op, d["codes"][0], n), unpack(op, ref["codes"][0], n)
    assert torch.equal(got[block:2 * block], want[block:2 * block]) and got[bad].item() == 0


# ---- layouts, host syncs -------------------------------------------------------------------------
@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_noncontiguous_params_and_grads(dev, backend, bits, kind, recorded):
    """The block layout is the logical (row-major) order: a transposed param / grad / master is
    staged and written back in place (against the reference), and steps to the same bytes as the
    contiguous call on contiguous copies."""
    op = op_name(kind, bits)
    require(op, dev, backend)
    s = make_state([(9, 33)], BF16, FP32_MASTER, dev, 64, steps=[4], op=op)
    s["params"][0] = s["params"][0].t().contiguous().t()
    s["masters"][0] = s["masters"][0].t().contiguous().t()
    p = s["params"][0]
    for _ in range(2):
        SL.new_grads(s, 1.0)
        s["grads"] = [g.t().contiguous().t() for g in s["grads"]]
        step_and_compare(op, s, backend, recorded, master_mode=FP32_MASTER, weight_decay=0.1)
    assert s["params"][0] is p and not p.is_contiguous()
    c = make_state([(64 * 65,)], BF16, REMAINDER, dev, DEFAULT_BLOCK[bits], steps=[4], op=op)
    t = lambda x: x.view(65, 64).t()  # noqa: E731  (64, 65), strides (1, 64)
    nc, ct = clone_state(c), clone_state(c)
    for k in ("params", "grads", "masters"):
        nc[k] = [t(nc[k][0])]
        ct[k] = [t(ct[k][0]).contiguous()]
    assert not nc["params"][0].is_contiguous()
    kw = dict(block_size=DEFAULT_BLOCK[bits], master_mode=REMAINDER)
    step(op, nc, backend, **kw)
    step(op, ct, backend, **kw)
    for k in KEYS:
        assert all(torch.equal(raw(x), raw(y)) for x, y in zip(nc[k], ct[k])), k


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_no_host_sync(dev, backend, bits, kind, monkeypatch, recorded):
    # Every scalar is read on device: no .item()/bool()/float() on a tensor.
    op = op_name(kind, bits)
    require(op, dev, backend)
    s = make_state([(70,), (0,), (5, 3)], BF16, STOCHASTIC, dev, 64, steps=[0, 2, 5], op=op)
    kw = dict(master_mode=STOCHASTIC, lr_tensor=torch.tensor(1e-2, device=dev),
              grad_scale=torch.tensor(4.0, device=dev), found_inf=torch.zeros((), device=dev),
              norm_sq=torch.tensor(2.0, device=dev), max_grad_norm=1.0)
    s0, expect = clone_state(s), clone_state(s)
    step(op, expect, "reference", **kw)
    qm.thresholds(qm.signed_map())  # the map's thresholds are cached host data, built once

    def boom(*a, **k):
        raise AssertionError("host sync in the kernel's path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    try:
        step(op, s, backend, **kw)
    finally:
        monkeypatch.undo()
    assert_matches_reference(op, s0, s, expect, recorded, kw)
