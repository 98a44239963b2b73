"""sgd8bit_step_ / lion8bit_step_ (one block-wise 8-bit state in bitsandbytes' layout) against
their float64 references (mpfused/reference/sgd8bit.py, lion8bit.py), one step from identical
inputs each time.

What must agree and how closely (EPS = fp32 epsilon, T = |grad * mult| + |old state| (+ wd |w|)
per element, Tb its maximum over the element's block; the kernel updates in fp32, the reference in
float64 rounded once):
* absmax: |kernel - reference| <= 16 EPS Tb;
* codes: equal, except one code apart where the reference's x = s * (1 / absmax) lies within
  16 EPS Tb / absmax of the decision point between the two codes (a threshold, or 0 for the sign
  rule's 126 / 127); such elements are counted: at most max(2, 0.5%) of a call's elements;
* params: OP_TOL of their dtype (1 ulp for 16-bit); for Lion, except where the reference's
  interpolation c = b1 m + (1 - b1) g is within 16 EPS (|m| + |g|) of 0 (sign(c) is then a
  rounding decision); fp32 masters and joined remainders: rtol 1e-6;
* step counters exact.
Measured: 9 codes explained by rounding in 105 calls of 71,258 elements (every dtype, master
mode and option, 3 seeds each); absmax and params well inside their bounds. Also: the encoding
itself (nearest code, sign rule, the binary-search fallback), NaN, thread counts and ISA builds
bit for bit.
The step's contract (skip, unscale, errors, ...): tests/test_sgd_lion_8bit_contract.py;
bitsandbytes' SGD8bit / Lion8bit: tests/test_sgd_lion_8bit_bnb.py."""
import hashlib

import pytest
import torch

import mpfused.reference.adam8bit as adam8bit_ref
import mpfused.reference.lion8bit as lion_ref
import mpfused.reference.sgd8bit as sgd_ref
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.reference.adam import remainder_join
from tests import isa_builds
from tests.test_adam_kernels import bits_equal, kernel_mode
from tests.test_adam8bit_kernels import CASES
from tests.test_quant8 import _brute_nearest, _probe_values
from tests.tolerances import OP_TOL

EPS = torch.finfo(torch.float32).eps
OP = {"sgd": "sgd8bit_step_", "lion": "lion8bit_step_"}
HYPER = {"sgd": dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                     maximize=False),
         "lion": dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False)}
NATIVE = OPS["sgd8bit_step_"].native_available("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="native extension not built")
KEYS = ("params", "grads", "codes", "absmax", "masters", "steps")


def _backends():
    """The backends to check against the reference: native, and Triton once its module exists."""
    out = [b for b in OPS["sgd8bit_step_"].available("cpu") if b != "reference"]
    try:
        OPS["sgd8bit_step_"].triton and OPS["lion8bit_step_"].triton
    except ImportError:
        out = [b for b in out if b != "triton"]
    return out


BACKENDS = _backends()


# ---- cases and calls ----------------------------------------------------------------------------
def make_case(sizes, dtype, mode, block, steps=(3,), seed=0):
    """Mid-training state: random params, grads, 8-bit state, masters within rounding of their
    param, per-tensor step counts (0: SGD's first step takes the gradient as its buffer). One
    element in 32 has a zero state and a tiny negative grad: its new state rounds to code 0 and
    the sign rule must store it one code below."""
    gen = torch.Generator().manual_seed(seed)
    c = {k: [] for k in KEYS}
    c.update(mode=mode, block=block)
    for i, n in enumerate(sizes):
        p32 = torch.randn(n, generator=gen) * 0.1
        c["params"].append(p32.to(dtype))
        g = torch.randn(n, generator=gen) * 1e-2
        codes, absmax = qm.quantize_blockwise(torch.randn(n, generator=gen) * 1e-2,
                                              qm.signed_map(), block)
        tiny = torch.rand(n, generator=gen) < 1 / 32
        g[tiny], codes[tiny] = -1e-9, qm.SIGNED_ZERO_CODE
        c["grads"].append(g.to(dtype))
        c["codes"].append(codes)
        c["absmax"].append(absmax)
        if mode == 1:
            c["masters"].append(p32 * (1 + 1e-4 * torch.randn(n, generator=gen)))
        elif mode == 2:
            c["masters"].append(torch.randint(-2**15, 2**15, (n,), generator=gen,
                                              dtype=torch.int16))
            # (+0, a negative remainder) is no master (its fp32 bits are a NaN's): randn draws an
            # exact 0 once in ~2**24
            c["masters"][-1][c["params"][-1] == 0] = 0
        c["steps"].append(torch.tensor(float(steps[i % len(steps)])))
    return c


def clone(c):
    return {k: [t.clone() for t in v] if k in KEYS else v for k, v in c.items()}


def hyper_args(kind, lr_tensor=None, **kw):
    """The op's hyperparameters, by keyword."""
    h = {**HYPER[kind], **kw}
    if kind == "sgd":
        return dict(lr=h["lr"], lr_tensor=lr_tensor, momentum=h["momentum"],
                    dampening=h["dampening"], weight_decay=h["weight_decay"],
                    nesterov=h["nesterov"], maximize=h["maximize"])
    return dict(lr=h["lr"], lr_tensor=lr_tensor, beta1=h["beta1"], beta2=h["beta2"],
                weight_decay=h["weight_decay"], maximize=h["maximize"])


def step(kind, c, backend="native", qmap=None, grad_scale=None, found_inf=None, norm_sq=None,
         max_grad_norm=0.0, lr_tensor=None, **hyper):
    qmap = qm.signed_map() if qmap is None else qmap
    OPS[OP[kind]](c["params"], c["grads"], c["codes"], c["absmax"], c["masters"], c["steps"],
                  qmap, block_size=c["block"], **hyper_args(kind, lr_tensor, **hyper),
                  master_mode=c["mode"], grad_scale=grad_scale, found_inf=found_inf,
                  norm_sq=norm_sq, max_grad_norm=max_grad_norm, seed=7, backend=backend)


@pytest.fixture
def recorded(monkeypatch):
    """The reference's float64 new states (before their fp32 rounding) and Lion's interpolations
    c, one entry per non-empty tensor in call order."""
    rec = {"state": [], "c": []}

    def store(codes, absmax, state, *args, **kw):
        rec["state"].append(state.clone())
        return adam8bit_ref.store_quantized(codes, absmax, state, *args, **kw)

    def lion_update(w, g, m, lr, beta1, beta2, update=lion_ref.lion_update):
        rec["c"].append(beta1 * m + (1 - beta1) * g)
        return update(w, g, m, lr, beta1, beta2)

    for mod in (sgd_ref, lion_ref):
        monkeypatch.setattr(mod, "store_quantized", store)
    monkeypatch.setattr(lion_ref, "lion_update", lion_update)
    return rec


# ---- the agreement check ------------------------------------------------------------------------
def per_block_max(t, block):
    nb = -(-t.numel() // block)
    pad = torch.nn.functional.pad(t, (0, nb * block - t.numel()))
    return pad.view(nb, block).amax(1).repeat_interleave(block)[: t.numel()]


def check_against_reference(kind, c0, got, ref, rec, mult=1.0, **hyper):
    """The agreement of the module docstring; returns the number of codes explained by rounding."""
    h = {**HYPER[kind], **hyper}
    qmap, block, zc = qm.signed_map(), c0["block"], qm.SIGNED_ZERO_CODE
    thr = qm.thresholds(qmap).double()
    explained, j = 0, 0
    for i, p0 in enumerate(c0["params"]):
        assert got["steps"][i].item() == ref["steps"][i].item() == c0["steps"][i].item() + 1
        if p0.numel() == 0:
            continue
        old = qm.dequantize_blockwise(c0["codes"][i], c0["absmax"][i], qmap, block).double()
        g = c0["grads"][i].double().abs() * abs(mult)
        t = g + old.abs() + h["weight_decay"] * p0.double().abs()
        tb = per_block_max(t, block)
        a_got, a_ref = got["absmax"][i].double(), ref["absmax"][i].double()
        assert ((a_got - a_ref).abs() <= 16 * EPS * tb[::block]).all(), i
        cg, cr = got["codes"][i].long(), ref["codes"][i].long()
        bad = cg != cr
        if bad.any():
            assert ((cg - cr).abs()[bad] == 1).all(), i
            scale = a_ref.repeat_interleave(block)[: p0.numel()]
            x = rec["state"][j].float().double() * qm.inv_scale(scale).double()
            lo = torch.minimum(cg, cr)
            dist = (x - thr[lo]).abs()
            dist = torch.where(lo == zc - 1, torch.minimum(dist, x.abs()), dist)  # sign rule
            assert (dist[bad] <= (16 * EPS * tb / scale)[bad]).all(), i
            explained += int(bad.sum())
        pg, pr = got["params"][i].double(), ref["params"][i].double()
        rtol, atol = OP_TOL[p0.dtype]
        close = (pg - pr).abs() <= atol + rtol * pr.abs()
        if kind == "lion":  # sign(c) of a c within rounding of 0 may go either way
            cref = rec["c"][j]
            close |= cref.abs() <= 16 * EPS * (old.abs() + g)
        assert close.all(), (i, int((~close).sum()))
        mode = kernel_mode(p0.dtype, c0["mode"])
        if mode == 1:
            torch.testing.assert_close(got["masters"][i], ref["masters"][i], rtol=1e-6, atol=1e-8)
        if mode == 2:
            torch.testing.assert_close(remainder_join(got["params"][i], got["masters"][i]),
                                       remainder_join(ref["params"][i], ref["masters"][i]),
                                       rtol=1e-6, atol=1e-8)
        j += 1
    n = sum(p.numel() for p in c0["params"])
    assert explained <= max(2, 0.005 * n), explained
    return explained


def run_both(kind, c, backend, recorded, mult=1.0, **kw):
    got, ref = clone(c), clone(c)
    step(kind, got, backend, **kw)
    step(kind, ref, "reference", **kw)
    return check_against_reference(kind, c, got, ref, recorded, mult, **{
        k: v for k, v in kw.items() if k in HYPER[kind]})


# ---- agreement over dtypes, master modes, options, sizes -----------------------------------------
OPTIONS = {"sgd": [dict(), dict(nesterov=True, weight_decay=1e-2),
                   dict(dampening=0.3, weight_decay=1e-2, maximize=True)],
           "lion": [dict(), dict(beta1=0.95, beta2=0.98, weight_decay=0.1, maximize=True)]}
OPTION_CASES = [(k, o) for k in ("sgd", "lion") for o in range(len(OPTIONS[k]))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mode", CASES, ids=[f"{str(d)[6:]}-m{m}" for d, m in CASES])
@pytest.mark.parametrize("kind,opt", OPTION_CASES, ids=[f"{k}{o}" for k, o in OPTION_CASES])
def test_matches_reference(kind, opt, dtype, mode, backend, recorded):
    # partial blocks, a 1-element and an empty tensor, a multi-chunk one; step 0 = SGD's first
    sizes = [700, 256, 1, 0, 300] + ([70001] if backend == "native" else [])
    c = make_case(sizes, dtype, mode, 256, steps=(3, 0, 9), seed=int(torch.randint(1 << 30, ())))
    # unscale by 2 and clip (norm 4, max 1): mult = 1/8, as fp32
    run_both(kind, c, backend, recorded, mult=0.125, grad_scale=torch.tensor(2.0),
             found_inf=torch.zeros(()), norm_sq=torch.tensor(16.0), max_grad_norm=1.0,
             **OPTIONS[kind][opt])


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("block", [64, 128, 256, 512, 1024, 2048, 4096])
def test_block_sizes_and_partial_blocks(kind, block, recorded):
    c = make_case([3 * 4096 + 5, 1, block - 1, block + 1, 32768 + 7], torch.float32, 0, block,
                  seed=block)
    run_both(kind, c, "native", recorded, weight_decay=1e-2)


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_many_small_tensors(kind, recorded):
    sizes = [int(n) for n in torch.randint(0, 90, (400,))]
    c = make_case(sizes, torch.bfloat16, 1, 64, steps=(0, 1, 5))
    run_both(kind, c, "native", recorded)


# ---- the encoding --------------------------------------------------------------------------------
@needs_native
def test_encode_equals_brute_force_nearest_with_the_sign_rule():
    """Lion with beta2 = 0 stores m = g exactly: in blocks whose absmax is 1 the codes must be the
    nearest entries of g (ties down) with the sign rule (a negative value never stores 0)."""
    s = qm.signed_map()
    x = _probe_values(s)
    x = torch.cat([x[x.abs() <= 1][: 255 * 60], -torch.rand(255 * 2) * 1e-7, torch.tensor([-0.0])])
    nb = -(-x.numel() // 255)
    x = torch.nn.functional.pad(x, (0, nb * 255 - x.numel()))
    g = torch.cat([torch.ones(nb, 1), x.view(nb, 255)], dim=1).reshape(-1)  # absmax 1 per block
    c = {"params": [torch.zeros_like(g)], "grads": [g], "codes": [torch.zeros_like(g).byte()],
         "absmax": [torch.zeros(nb)], "masters": [], "steps": [torch.zeros(())], "mode": 0,
         "block": 256}
    step("lion", c, beta1=0.5, beta2=0.0)
    assert torch.equal(c["absmax"][0], torch.ones(nb))
    want = _brute_nearest(g, s)
    want = torch.where(torch.signbit(g) & (want == qm.SIGNED_ZERO_CODE), want - 1, want)
    assert torch.equal(c["codes"][0].long(), want)
    assert int((c["codes"][0] == qm.SIGNED_ZERO_CODE - 1).sum()) >= 2 * 255  # the rule fired


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_map_the_lut_cannot_encode_takes_the_binary_search(kind, recorded):
    """A signed map with entries closer than a bf16 bin: the LUT is not exact, the kernel falls
    back to quant8_encode + quant8_keep_negative; same rules as the reference."""
    q = qm.signed_map().clone()
    q[200:210] = q[200] + torch.arange(10) * 2.0**-22  # ten entries in one bf16 bin
    assert bool((q[1:] > q[:-1]).all())
    c = make_case([5000, 77], torch.float32, 0, 256)
    for t in c["codes"]:  # states that land in the dense stretch too
        t[::3] = 205
    got, ref = clone(c), clone(c)
    step(kind, got, qmap=q)
    step(kind, ref, "reference", qmap=q)
    for a, b in zip(got["codes"], ref["codes"]):
        assert (a.int() - b.int()).abs().max() <= 1 and (a != b).sum() <= 2
    for a, b in zip(got["absmax"], ref["absmax"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_nan_grad_poisons_its_block_only(kind):
    c = make_case([1024], torch.float32, 0, 256)
    c["grads"][0][300] = float("nan")  # block 1
    got, ref = clone(c), clone(c)
    step(kind, got)
    step(kind, ref, "reference")
    assert got["absmax"][0].isnan().tolist() == [False, True, False, False]
    assert ref["absmax"][0].isnan().tolist() == [False, True, False, False]
    keep = torch.ones(1024, dtype=torch.bool)
    keep[256:512] = False  # elsewhere: the usual agreement (codes apart only at a threshold)
    assert int((got["codes"][0] != ref["codes"][0])[keep].sum()) <= 2
    torch.testing.assert_close(got["absmax"][0][[0, 2, 3]], ref["absmax"][0][[0, 2, 3]],
                               rtol=1e-6, atol=0)
    assert got["params"][0][300].isnan()  # Lion: sign(NaN) is NaN, not a silent zero step


# ---- determinism: thread counts, ISA builds ----------------------------------------------------
@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_bit_identical_for_any_thread_count(kind):
    c = make_case([200_001, 3000], torch.bfloat16, 3, 256)
    outs = []
    n = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            d = clone(c)
            step(kind, d)
            outs.append(d)
    finally:
        torch.set_num_threads(n)
    for d in outs[1:]:
        for k in KEYS:
            assert all(bits_equal(x, y) for x, y in zip(d[k], outs[0][k])), k


def isa_digest(seed: int) -> str:
    """The bytes both kernels write over CASES (tests/isa_builds.py runs it once per ISA build)."""
    h = hashlib.sha256()
    for kind in ("sgd", "lion"):
        for dtype, mode in CASES:  # tiles, blocks and a multi-chunk tensor; first and later steps
            c = make_case([1, 63, 64, 65, 1000, 70001], dtype, mode, 256, steps=(0, 4), seed=seed)
            for _ in range(2):
                step(kind, c, weight_decay=1e-2)
            for k in KEYS:
                for t in c[k]:
                    h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@needs_native
def test_every_cpu_isa_build_is_bit_identical():
    """The kernels are built per ISA (baseline, x86-64-v3, v4, v4 + VBMI decode), capped by
    MPFUSED_CPU_ISA: every build must give the same bytes."""
    digests = isa_builds.digests("sgd_lion_8bit")
    assert len(set(digests.values())) == 1, digests
