"""sgd4bit_step_ / lion4bit_step_ (one block-wise 4-bit state, torchao's format of AdamW4bit's
first moment) against their float64 references (mpfused/reference/sgd4bit.py, lion4bit.py), one
step from identical inputs each time, on every backend; Triton (interpreter) = native bit for bit;
the codec = AdamW4bit's m codec byte for byte; found_inf skips bit-exactly; NaN and inf;
non-contiguous params; every CPU ISA build and thread count bit-identical.

Also opcheck, bound lists = the plain call, torch.compile of the optimizer step = eager.

Agreement with the reference (the kernel updates in fp32, the reference in float64 rounded once):
params within fp32 rounding (16-bit params: one ulp; Lion: except where the interpolation
c = b1 m + (1 - b1) g is within 16 EPS (|m| + |g|) of 0, where sign(c) is a rounding decision);
codes equal except one apart (a state within rounding of a decision threshold), at most
max(1, 1%) of a tensor's elements; absmax to fp32 rounding of its terms (ABSMAX_TOL_OF_TERMS);
masters rtol 1e-6; step counters exact."""
import hashlib

import pytest
import torch

from mpfused import quant4 as q4
from mpfused.ops import OPS
from tests import isa_builds
from tests.tolerances import ABSMAX_TOL_OF_TERMS

OP_UNDER_TEST = "sgd4bit_step_"  # conftest: (device, backend) over this op's backends
OP = {"sgd": "sgd4bit_step_", "lion": "lion4bit_step_"}
NATIVE = OPS["sgd4bit_step_"].native_available("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="no native sgd4bit_step_ in this build")
EPS = torch.finfo(torch.float32).eps
HYPER = {"sgd": dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                     maximize=False),
         "lion": dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False)}
OPTIONS = {"sgd": [dict(), dict(nesterov=True, weight_decay=1e-2),
                   dict(dampening=0.3, weight_decay=1e-2, maximize=True)],
           "lion": [dict(), dict(beta1=0.95, beta2=0.98, weight_decay=0.1, maximize=True)]}
# every master mode: none (fp32 params), fp32 master, none, remainder, SR (3), remainder8 (4)
CASES = [(torch.float32, 0), (torch.float16, 1), (torch.float16, 0), (torch.bfloat16, 1),
         (torch.bfloat16, 2), (torch.bfloat16, 3), (torch.bfloat16, 4)]
KEYS = ("params", "grads", "codes", "absmax", "masters", "steps")
BLOCK = 128


def make_case(sizes, dtype, mode, block=BLOCK, steps=(3,), seed=0):
    """Mid-training state: random params, grads, 4-bit state, masters, per-tensor step counts
    (0: SGD's first step takes the gradient as its buffer)."""
    gen = torch.Generator().manual_seed(seed)
    c = {k: [] for k in KEYS}
    c.update(mode=mode, block=block)
    for i, n in enumerate(sizes):
        p32 = torch.randn(n, generator=gen) * 0.1
        c["params"].append(p32.to(dtype))
        c["grads"].append((torch.randn(n, generator=gen) * 1e-2).to(dtype))
        codes, absmax = q4.quantize4_blockwise(torch.randn(n, generator=gen) * 1e-2,
                                               q4.signed4_map(), block)
        c["codes"].append(codes)
        c["absmax"].append(absmax)
        if mode == 1:
            c["masters"].append(p32 * (1 + 1e-4 * torch.randn(n, generator=gen)))
        elif mode == 2:
            c["masters"].append(torch.randint(-2**15, 2**15, (n,), generator=gen,
                                              dtype=torch.int16))
        elif mode == 4:
            c["masters"].append(torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8))
        if mode in (2, 4):  # (+0, a negative remainder) is no master (its fp32 bits are a NaN's):
            c["masters"][-1][c["params"][-1] == 0] = 0  # randn draws an exact 0 once in ~2**24
        c["steps"].append(torch.tensor(float(steps[i % len(steps)])))
    return c


def clone(c):
    return {k: [t.clone() for t in v] if k in KEYS else v for k, v in c.items()}


def step(kind, c, backend="native", grad_scale=None, found_inf=None, norm_sq=None,
         max_grad_norm=0.0, lr_tensor=None, qmap=None, **hyper):
    OPS[OP[kind]](c["params"], c["grads"], c["codes"], c["absmax"], c["masters"], c["steps"],
                  q4.signed4_map() if qmap is None else qmap, block_size=c["block"],
                  lr_tensor=lr_tensor, **{**HYPER[kind], **hyper}, master_mode=c["mode"],
                  grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
                  max_grad_norm=max_grad_norm, seed=7, backend=backend)


def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(
        torch.uint8)


def check_against_reference(kind, c0, got, ref, mult=1.0, **hyper):
    h = {**HYPER[kind], **hyper}
    qmap, block = q4.signed4_map(), c0["block"]
    for i, p0 in enumerate(c0["params"]):
        n = p0.numel()
        assert got["steps"][i].item() == ref["steps"][i].item() == c0["steps"][i].item() + 1
        if n == 0:
            continue
        old = q4.dequantize4_blockwise(c0["codes"][i], c0["absmax"][i], qmap, block,
                                       (n,)).double()
        g = c0["grads"][i].double() * mult * (-1 if h["maximize"] else 1)
        pg, pr = got["params"][i].double(), ref["params"][i].double()
        if p0.dtype == torch.float32:
            close = (pg - pr).abs() <= 2e-6 * pr.abs() + 1e-8
        else:  # a 16-bit param may round the other way at a tie of the fp32 value
            close = (pg - pr).abs() <= torch.finfo(p0.dtype).eps * pr.abs().clamp_min(1e-3)
        if kind == "lion":
            cref = h["beta1"] * old + (1 - h["beta1"]) * g
            close |= cref.abs() <= 16 * EPS * (old.abs() + g.abs())
        assert bool(close.all()), (i, int((~close).sum()))
        cg, cr = q4.unpack4(got["codes"][i], n), q4.unpack4(ref["codes"][i], n)
        assert bool(((cg - cr).abs() <= 1).all()), i
        assert (cg != cr).sum().item() <= max(1, 0.01 * n), i
        if n % 2:  # the padding nibble of an odd-sized tensor stays 0
            assert int(got["codes"][i][-1]) & 0xF == 0
        terms = (old.abs().max() + g.abs().max()).item() + h["weight_decay"] * p0.abs().max()
        torch.testing.assert_close(got["absmax"][i], ref["absmax"][i], rtol=1e-6,
                                   atol=ABSMAX_TOL_OF_TERMS * float(terms))
        if got["masters"] and got["masters"][i].dtype == torch.float32:
            torch.testing.assert_close(got["masters"][i], ref["masters"][i], rtol=1e-6,
                                       atol=1e-8)


def run_both(kind, c, backend, mult=1.0, **kw):
    got, ref = clone(c), clone(c)
    step(kind, got, backend, **kw)
    step(kind, ref, "reference", **kw)
    check_against_reference(kind, c, got, ref, mult,
                            **{k: v for k, v in kw.items() if k in HYPER[kind]})
    return got


OPTION_CASES = [(k, o) for k in ("sgd", "lion") for o in range(len(OPTIONS[k]))]


@pytest.mark.parametrize("dtype,mode", CASES, ids=[f"{str(d)[6:]}-m{m}" for d, m in CASES])
@pytest.mark.parametrize("kind,opt", OPTION_CASES, ids=[f"{k}{o}" for k, o in OPTION_CASES])
def test_matches_reference(device, backend, kind, opt, dtype, mode):
    if backend == "reference":
        pytest.skip("the reference is what is compared against")
    # odd sizes, partial blocks, a 1-element and an empty tensor; natively a multi-chunk one
    # (with the first options only: the float64 reference of 70001 elements costs seconds)
    sizes = [701, 128, 1, 0, 257] + ([70001] if backend == "native" and opt == 0 else [])
    c = make_case(sizes, dtype, mode, steps=(3, 0, 9), seed=int(torch.randint(1 << 30, ())))
    # unscale by 2 and clip (norm 4, max 1): mult = 1/8, as fp32
    run_both(kind, c, backend, mult=0.125, grad_scale=torch.tensor(2.0),
             found_inf=torch.zeros(()), norm_sq=torch.tensor(16.0), max_grad_norm=1.0,
             lr_tensor=torch.tensor(HYPER[kind]["lr"]) if opt == 1 else None,
             **OPTIONS[kind][opt])


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("block", [64, 4096])
def test_block_sizes(kind, block):
    c = make_case([3 * 4096 + 5, 1, block - 1, block + 1], torch.float32, 0, block, seed=block)
    run_both(kind, c, "native", weight_decay=1e-2)


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_found_inf_skips_bit_exactly(device, backend, kind):
    c = make_case([301, 1, 0], torch.bfloat16, 2, steps=(0, 5))
    d = clone(c)
    step(kind, d, backend, found_inf=torch.ones(()), grad_scale=torch.tensor(4.0))
    for k in KEYS:
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(c[k], d[k])), k


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_nan_grad_poisons_its_block_only(device, backend, kind):
    c = make_case([512], torch.float32, 0)
    c["grads"][0][200] = float("nan")  # block 1
    d = clone(c)
    step(kind, d, backend)
    assert d["absmax"][0].isnan().tolist() == [False, True, False, False]
    assert d["params"][0][200].isnan()  # SGD: w - lr NaN; Lion: sign(NaN) is NaN, not 0
    ref = clone(c)
    step(kind, ref, "reference")
    keep = torch.ones(512, dtype=torch.bool)
    keep[128:256] = False
    n = 512
    assert int((q4.unpack4(d["codes"][0], n) != q4.unpack4(ref["codes"][0], n))[keep].sum()) <= 2
    torch.testing.assert_close(d["absmax"][0][[0, 2, 3]], ref["absmax"][0][[0, 2, 3]],
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_inf_grad_gives_an_inf_absmax(device, backend, kind):
    """An inf state: its block's absmax is inf, x = s * (1 / inf) is 0 for the finite states and
    NaN (code 0) for the inf one, as the reference encodes it."""
    c = make_case([512], torch.float32, 0)
    c["grads"][0][200] = float("inf")  # block 1
    d, ref = clone(c), clone(c)
    step(kind, d, backend)
    step(kind, ref, "reference")
    assert d["absmax"][0][1].item() == float("inf") == ref["absmax"][0][1].item()
    got, want = q4.unpack4(d["codes"][0], 512), q4.unpack4(ref["codes"][0], 512)
    assert torch.equal(got[128:256], want[128:256]) and got[200].item() == 0


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_non_contiguous_params_and_grads(device, backend, kind):
    """Transposed params / grads / masters are stepped in their logical (row-major) order: the
    same bytes as the contiguous call on their contiguous copies."""
    c = make_case([64 * 65], torch.bfloat16, 2, steps=(4,))
    t = lambda x: x.view(65, 64).t()  # noqa: E731  (64, 65), strides (1, 64)
    nc = clone(c)
    nc.update(params=[t(nc["params"][0])], grads=[t(nc["grads"][0])],
              masters=[t(nc["masters"][0])])
    ct = clone(c)
    ct.update(params=[t(ct["params"][0]).contiguous()], grads=[t(ct["grads"][0]).contiguous()],
              masters=[t(ct["masters"][0]).contiguous()])
    assert not nc["params"][0].is_contiguous()
    step(kind, nc, backend)
    step(kind, ct, backend)
    for k in KEYS:
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(nc[k], ct[k])), k


@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_argument_errors_name_the_rule(device, backend, kind):
    c = make_case([300], torch.float32, 0)
    bad = {**clone(c), "codes": [torch.zeros(300, dtype=torch.uint8)]}  # 8-bit sized
    with pytest.raises(RuntimeError, match="ceil"):
        step(kind, bad, backend)
    with pytest.raises(RuntimeError, match="16"):
        step(kind, clone(c), backend, qmap=torch.linspace(-1, 1, 256))
    if kind == "sgd":
        with pytest.raises(RuntimeError, match="momentum must be > 0"):
            step(kind, clone(c), backend, momentum=0.0)


# ---- the codec: AdamW4bit's first-moment codec, byte for byte ------------------------------------
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_codes_equal_adamw4bit_m_codec(backend):
    """A state that is exactly g (SGD's first step; Lion with beta2 = 0; adam4bit_step_ from a zero
    state with beta1 = 0) is encoded as AdamW4bit's m codec (quant4.quantize4_blockwise with the
    signed map, as its QuantState) and as adam4bit_step_'s kernel encodes it: same bytes."""
    if backend == "native" and not NATIVE:
        pytest.skip("no native build")
    if backend not in OPS["sgd4bit_step_"].available("cpu"):
        pytest.skip(f"{backend} unavailable")
    n = 3 * 128 + 77 if backend == "triton" else 50_001
    g = torch.randn(n) * torch.logspace(-6, 1, n)[torch.randperm(n)]
    want_codes, want_absmax = q4.quantize4_blockwise(g, q4.signed4_map(), BLOCK)
    zero = lambda: make_case([n], torch.float32, 0, steps=(0,))  # noqa: E731
    for kind, hyper in (("sgd", {}), ("lion", dict(beta2=0.0))):
        c = zero()
        c["grads"] = [g.clone()]
        step(kind, c, backend, **hyper)
        assert torch.equal(c["codes"][0], want_codes), kind
        assert torch.equal(c["absmax"][0], want_absmax), kind
    c1, a1 = q4.zero_codes4(n, True), torch.zeros(-(-n // BLOCK))
    c2, a2 = q4.zero_codes4(n, False), torch.zeros(-(-n // BLOCK))
    OPS["adam4bit_step_"]([torch.zeros(n)], [g.clone()], [c1], [c2], [a1], [a2], [],
                          [torch.zeros(())], q4.signed4_map(), q4.unsigned4_map(),
                          block_size=BLOCK, lr=1e-3, lr_tensor=None, beta1=0.0, beta2=0.999,
                          eps=1e-8, weight_decay=0.0, maximize=False, decoupled=True,
                          master_mode=0, backend=backend)
    assert torch.equal(c1, want_codes) and torch.equal(a1, want_absmax)


# ---- backends and builds bit for bit ------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_triton_interpreter_equals_native_bit_for_bit(kind):
    if "triton" not in OPS[OP[kind]].available("cpu"):
        pytest.skip("no Triton interpreter (TRITON_INTERPRET=1)")
    for dtype, mode in CASES[::2] + [(torch.bfloat16, 4)]:
        a = make_case([700, 129, 1, 0, 257], dtype, mode, 64, steps=(0, 3), seed=mode)
        b = clone(a)
        gen = torch.Generator().manual_seed(11)
        for s in range(3):
            grads = [(torch.randn(x.numel(), generator=gen) * 1e-2).to(dtype)
                     for x in a["params"]]
            a["grads"], b["grads"] = grads, [x.clone() for x in grads]
            found = torch.ones(()) if s == 1 else None
            step(kind, a, "native", found_inf=found, weight_decay=1e-2)
            step(kind, b, "triton", found_inf=found, weight_decay=1e-2)
        for k in KEYS:
            assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a[k], b[k])), (dtype, k)


@needs_native
def test_bit_identical_for_any_thread_count():
    c = make_case([200_001, 3001], torch.bfloat16, 3)
    outs, n = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for kind in ("sgd", "lion"):
                d = clone(c)
                step(kind, d)
                outs.append(d)
    finally:
        torch.set_num_threads(n)
    for d, e in zip(outs[2:], outs):
        for k in KEYS:
            assert all(torch.equal(bits(x), bits(y)) for x, y in zip(d[k], e[k])), k


def isa_digest(seed: int) -> str:
    """The bytes both kernels write (tests/isa_builds.py runs it once per ISA build)."""
    h = hashlib.sha256()
    for kind in ("sgd", "lion"):
        for dtype, mode in [CASES[i] for i in (0, 1, 5, 6)]:  # fp32, fp32 master, SR, remainder8
            c = make_case([1, 63, 64, 65, 1001, 70001], dtype, mode, 128, steps=(0, 4), seed=seed)
            for _ in range(2):
                step(kind, c, weight_decay=1e-2)
            for k in KEYS:
                for t in c[k]:
                    h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@needs_native
def test_every_cpu_isa_build_is_bit_identical():
    """Baseline, x86-64-v3, v4 (4-bit: the vpermps decode) and a VBMI CPU (4-bit takes v4):
    every build gives the same bytes (the processes are shared with the other block-wise
    families: tests/isa_builds.py)."""
    digests = isa_builds.digests("sgd_lion_4bit")
    assert len(set(digests.values())) == 1, digests


# ---- dispatcher: opcheck, bound lists, torch.compile ------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("dtype,mode", [(torch.float32, 0), (torch.bfloat16, 4)])
def test_opcheck(kind, dtype, mode):
    """Schema (scalars keyword-only), fake kernel and aot dispatch of both ops on CPU."""
    c = make_case([301], dtype, mode)
    args = (c["params"], c["grads"], c["codes"], c["absmax"], c["masters"], c["steps"],
            q4.signed4_map())
    kwargs = dict(block_size=BLOCK, lr_tensor=None, **{**HYPER[kind], "weight_decay": 0.01},
                  master_mode=mode, grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()),
                  seed=3)
    torch.library.opcheck(OPS[OP[kind]].overload, args, kwargs)


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_bound_lists_compute_the_plain_call(kind):
    from mpfused.ops.bound import BoundOp
    c = make_case([500, 3, 0], torch.bfloat16, 2, steps=(0,))
    plain, bound = clone(c), clone(c)
    call = BoundOp(OPS[OP[kind]], [bound["params"], bound["codes"], bound["absmax"],
                                   bound["masters"], bound["steps"]], [4, 1, 9], [0, 8, 0])
    qmap = q4.signed4_map()
    kw = dict(block_size=BLOCK, lr_tensor=None, **HYPER[kind], master_mode=2, grad_scale=None,
              found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=5)
    for _ in range(2):
        OPS[OP[kind]](plain["params"], plain["grads"], plain["codes"], plain["absmax"],
                      plain["masters"], plain["steps"], qmap, **kw, param_ids=[4, 1, 9],
                      elem_offsets=[0, 8, 0], backend="native")
        call(bound["grads"], qmap, **kw, backend="native")
    assert call._native is not None  # the C++ lists served the calls
    for k in KEYS:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(plain[k], bound[k])), k


@pytest.mark.parametrize("cls", ["SGD4bit", "Lion4bit"])
def test_compiled_optimizer_step_equals_eager(cls, monkeypatch):
    """tests/test_compile_sgd_lion.py's check: fullgraph, bit-equal to eager, no recompile."""
    import mpfused
    from tests import test_compile_sgd_lion as tc
    kwargs = dict(min_8bit_size=256, **(dict(momentum=0.9, nesterov=True)
                                        if cls == "SGD4bit" else {}))
    monkeypatch.setitem(tc.CASES, cls, (getattr(mpfused, cls), kwargs, OP[cls[:-4].lower()]))
    torch._dynamo.reset()
    tc.counters.clear()
    eager = tc._optimizer_loop(False, getattr(mpfused, cls), kwargs)
    compiled = tc._optimizer_loop(True, getattr(mpfused, cls), kwargs)
    torch._dynamo.reset()
    assert any(t.dtype == torch.uint8 for t in compiled)  # 4-bit state was traced
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert 1 <= tc.counters["stats"]["unique_graphs"] <= 2
