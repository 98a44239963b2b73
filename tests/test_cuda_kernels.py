"""Native CUDA kernels (csrc/cuda via csrc/bindings/*_cuda.cpp) against mpfused.reference.

Every native call runs under torch.cuda.set_sync_debug_mode("error"): the CUDA path must never
synchronize with the host. Comparisons use the tolerances of tests/tolerances.py for a single
application of an op; multi-step Adam runs re-sync the reference state from the kernel's after each
step, so every comparison is a single application. Skipped without a GPU, or when the extension
was built without its CUDA kernels."""
import contextlib
import math

import pytest
import torch

from mpfused import _extension
from mpfused.ops import OPS
from mpfused.reference import adam as ref_adam
from mpfused.reference import amp as ref_amp
from tests.tolerances import OP_TOL, REMAINDER8_TOL, assert_close

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _extension.with_cuda(),
                       reason="mpfused extension built without its CUDA kernels"),
]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIXED = "mixed"
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32 partial sums vs the float64 reference
MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8 = 0, 1, 2, 3, 4
MODES = [MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8]


@contextlib.contextmanager
def no_host_sync():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def native(name, *args, **kwargs):
    with no_host_sync():
        OPS[name](*args, **kwargs, backend="native")


UPDATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale",
               "max_scale")


def update_kw(*values):
    """update_scale_'s keyword arguments from (growth, backoff, interval, hysteresis, min, max)."""
    return dict(zip(UPDATE_KEYS, values))


def scalar(x, dtype=torch.float32, device=DEV):
    return torch.tensor(x, dtype=dtype, device=device)


def with_layout(x, layout):
    """A tensor holding x's values, laid out as asked: contig; offset (contiguous, 1 element past
    an aligned address: the kernels' scalar path); strided (every other element: not dense, so the
    bindings stage it); transposed (2-D, dense but not contiguous)."""
    shape = tuple(x.shape)
    kw = {"dtype": x.dtype, "device": x.device}
    if layout == "contig":
        out = torch.empty(shape, **kw)
    elif layout == "offset":
        out = torch.empty(x.numel() + 1, **kw)[1:].view(shape)
    elif layout == "strided":
        out = torch.empty(shape[:-1] + (2 * shape[-1],), **kw)[..., ::2]
    elif layout == "transposed":
        assert len(shape) == 2
        out = torch.empty(shape[::-1], **kw).t()
    else:
        raise ValueError(layout)
    out.copy_(x)
    return out


def dtype_cycle(dtype, n, mode=None):
    """n dtypes: `dtype`, or MIXED's fp32 / fp16 / bf16 in turn. Master mode 4 (remainder8) needs
    bf16 or fp32 params (the bindings refuse fp16): MIXED is then fp32 / bf16, fp16 a skip."""
    if mode == MASTER_REMAINDER8:
        if dtype == torch.float16:
            pytest.skip("remainder8 (master mode 4) needs bf16 or fp32 params")
        if dtype == MIXED:
            return [(torch.float32, torch.bfloat16)[i % 2] for i in range(n)]
    return [DTYPES[i % 3] for i in range(n)] if dtype == MIXED else [dtype] * n


def clones(ts):
    return [t.clone() for t in ts]


# ---------------------------------------------------------------------------------------------
# check_grads / unscale_grads_
# ---------------------------------------------------------------------------------------------

SIZES = [1, 3, 17, 255, 4096, 4099, 65536, 65537, 3 * 65536 + 5, 0, 250_001]


def make_grads(sizes, dtype, layouts=("contig",), scale=8.0):
    dts = dtype_cycle(dtype, len(sizes))
    out = []
    for i, (shape, dt) in enumerate(zip(sizes, dts)):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        layout = layouts[i % len(layouts)]
        if layout == "transposed" and len(shape) != 2:
            layout = "contig"
        x = (torch.randn(shape, device=DEV) * scale).to(dt)
        out.append(with_layout(x, layout))
    return out


def run_check(grads, op, inv, found0=0.0, norm=True, per_tensor=True):
    """Runs the native op and the reference on copies; returns both sets of outputs."""
    out = {}
    ref_grads = clones(grads)  # before the native op writes the grads
    for kind in ("native", "ref"):
        gs = grads if kind == "native" else ref_grads
        found = scalar(found0)
        inv_t = scalar(inv)
        ns = scalar(1.25) if norm else None
        per = torch.linspace(0.5, 1.5, len(gs), device=DEV) if per_tensor else None
        args, kwargs = (gs, found, inv_t), dict(norm_sq=ns, norm_sq_per_tensor=per)
        if kind == "native":
            native(op, *args, **kwargs)
        else:
            getattr(ref_amp, op)(*args, **kwargs)
        out[kind] = dict(grads=gs, found=found, norm=ns, per=per)
    return out["native"], out["ref"]


@pytest.mark.parametrize("op", ["unscale_grads_", "check_grads"])
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_matches_reference(op, dtype):
    grads = make_grads(SIZES, dtype)
    before = clones(grads)
    nat, ref = run_check(grads, op, inv=1.0 / 3.0)
    assert nat["found"].item() == ref["found"].item() == 0.0
    for g, r, b in zip(nat["grads"], ref["grads"], before):
        if op == "check_grads":
            assert torch.equal(g, b), "check_grads must not write the grads"
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("layouts", [("offset",), ("strided",), ("transposed",),
                                     ("contig", "offset", "strided", "transposed")], ids=str)
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_noncontiguous(dtype, layouts):
    sizes = [(37, 129), (300, 257), (1, 5), (0, 4), (1030, 70), (2, 3)]
    grads = make_grads(sizes, dtype, layouts)
    strides = [g.stride() for g in grads]
    nat, ref = run_check(grads, "unscale_grads_", inv=0.125)
    for g, r, s in zip(nat["grads"], ref["grads"], strides):
        assert g.stride() == s  # written in place (staged tensors are copied back)
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_check_many_small_tensors(dtype):
    # ~1000 tensors: several launches (the per-launch tensor limit is ~130-180).
    sizes = torch.randint(0, 300, (1000,)).tolist()
    grads = make_grads(sizes, dtype)
    nat, ref = run_check(grads, "unscale_grads_", inv=0.5)
    for g, r in zip(nat["grads"], ref["grads"]):
        assert_close(g, r, g.dtype)
    torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("norm,per_tensor", [(False, False), (True, False), (False, True)])
def test_check_optional_outputs(norm, per_tensor):
    grads = make_grads(SIZES, MIXED)
    nat, ref = run_check(grads, "unscale_grads_", inv=0.25, norm=norm, per_tensor=per_tensor)
    for g, r in zip(nat["grads"], ref["grads"]):
        assert_close(g, r, g.dtype)
    if norm:
        torch.testing.assert_close(nat["norm"], ref["norm"], **NORM_TOL)
    if per_tensor:
        torch.testing.assert_close(nat["per"], ref["per"], **NORM_TOL)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["vector", "tail", "misaligned", "small"])
@pytest.mark.parametrize("op", ["unscale_grads_", "check_grads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_found_inf(dtype, op, where, bad):
    grads = make_grads([1000, 65536 + 3, 7], dtype)
    if where == "vector":
        grads[1][12345] = bad
    elif where == "tail":
        grads[1][-1] = bad
    elif where == "misaligned":
        grads[0] = with_layout(grads[0], "offset")
        grads[0][501] = bad
    else:
        grads[2][3] = bad
    nat, ref = run_check(grads, op, inv=0.5)
    assert nat["found"].item() == ref["found"].item() == 1.0
    for g, r in zip(nat["grads"], ref["grads"]):
        rtol, atol = OP_TOL[g.dtype]
        torch.testing.assert_close(g.double(), r.double(), rtol=rtol, atol=atol, equal_nan=True)


def test_found_inf_is_never_cleared():
    grads = make_grads([100, 70000], MIXED)
    found = scalar(1.0)
    native("check_grads", grads, found, scalar(1.0))
    assert found.item() == 1.0
    found = scalar(0.0)
    native("check_grads", grads, found, scalar(1.0))
    assert found.item() == 0.0


def test_norm_is_deterministic():
    grads = make_grads([300_001, 5, 65536 * 4 + 1, 1000], MIXED)
    outs = []
    for _ in range(3):
        ns, per = scalar(0.0), torch.zeros(4, device=DEV)
        native("check_grads", grads, scalar(0.0), scalar(0.1), norm_sq=ns, norm_sq_per_tensor=per)
        outs.append((ns, per))
    for ns, per in outs[1:]:
        assert torch.equal(ns, outs[0][0]) and torch.equal(per, outs[0][1])


def test_empty_lists_and_all_empty_tensors():
    found, ns, per = scalar(0.0), scalar(2.0), torch.ones(2, device=DEV)
    native("unscale_grads_", [], found, scalar(1.0), norm_sq=ns)
    native("unscale_grads_", [torch.empty(0, device=DEV), torch.empty(0, 3, device=DEV)],
           found, scalar(1.0), norm_sq=ns, norm_sq_per_tensor=per)
    assert found.item() == 0.0 and ns.item() == 2.0 and per.tolist() == [1.0, 1.0]


def test_check_errors():
    g = [torch.randn(4, device=DEV)]
    with pytest.raises(RuntimeError, match="found_inf"):
        OPS["check_grads"](g, torch.zeros(()), scalar(1.0), backend="native")
    with pytest.raises(RuntimeError, match="norm_sq_per_tensor"):
        OPS["check_grads"](g, scalar(0.0), scalar(1.0), norm_sq=None,
                           norm_sq_per_tensor=torch.zeros(2, device=DEV),
                           backend="native")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        OPS["check_grads"]([torch.ones(3, device=DEV, dtype=torch.float64)], scalar(0.0),
                           scalar(1.0), backend="native")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 12 * 2**30,
                    reason="needs 12 GB of free GPU memory (uses ~4.3 GB)")
def test_check_beyond_int32_elements():
    n = 2**31 + 1000
    g = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    hi = 2**31 + 500
    g[hi] = 4.0
    found, ns = scalar(0.0), scalar(0.0)
    native("unscale_grads_", [g], found, scalar(0.5), norm_sq=ns)
    assert found.item() == 0.0
    assert g[0].item() == 0.5 and g[hi].item() == 2.0 and g[-1].item() == 0.5
    assert ns.item() == pytest.approx((n - 1) * 0.25 + 4.0, rel=1e-6)
    g[2**31 + 999] = float("nan")
    native("check_grads", [g], found, scalar(1.0))
    assert found.item() == 1.0
    del g
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# update_scale_
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    (2.0, 0.5, 3, 1, 0.0, math.inf),        # torch._amp_update_scale_
    (2.0, 0.5, 2, 3, 1.0, 2.0**20),         # hysteresis, min and max
    (1.5, 0.25, 1, 2, 0.0, math.inf),
])
def test_update_scale_matches_reference(cfg):
    growth, backoff, interval, hyst, mn, mx = cfg
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    nat = [scalar(2.0**16), scalar(0, torch.int32), scalar(hyst, torch.int32)]
    ref = [t.clone() for t in nat]
    for _ in range(40):
        f = float(torch.rand((), generator=gen) < 0.3)
        upd = update_kw(growth, backoff, interval, hyst, mn, mx)
        native("update_scale_", *nat, scalar(f), **upd)
        ref_amp.update_scale_(*ref, scalar(f), **upd)
        for a, b in zip(nat, ref):
            assert torch.equal(a, b)


def test_update_scale_refuses_non_finite_growth():
    s, g, h = scalar(3e38), scalar(0, torch.int32), scalar(1, torch.int32)
    native("update_scale_", s, g, h, scalar(0.0), **update_kw(2.0, 0.5, 1, 1, 0.0, math.inf))
    assert s.item() == pytest.approx(3e38) and g.item() == 0


# ---------------------------------------------------------------------------------------------
# adam_step_
# ---------------------------------------------------------------------------------------------

class AdamCase:
    """One adam_step_ call: state on the GPU, a native copy and a reference copy."""

    def __init__(self, shapes, dtypes, mode, layouts=("contig",), amsgrad=False,
                 decoupled=True, maximize=False, weight_decay=0.01, grad_scale=None,
                 clip=False, lr_kind="float", state_layout_same=False):
        self.mode, self.amsgrad = mode, amsgrad
        self.params, self.grads, self.m, self.v, self.vmax, self.masters = [], [], [], [], [], []
        for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            layout = layouts[i % len(layouts)]
            if layout == "transposed" and len(shape) != 2:
                layout = "contig"
            state_layout = layout if state_layout_same else "contig"
            w0 = torch.randn(shape, device=DEV)
            if mode == MASTER_REMAINDER and dt == torch.bfloat16:
                p0, rem = ref_adam.remainder_split(w0.contiguous())
                self.masters.append(with_layout(rem, state_layout))
            elif mode == MASTER_REMAINDER8 and dt == torch.bfloat16:
                p0, rem = ref_adam.remainder8_split(w0.contiguous())
                self.masters.append(with_layout(rem, state_layout))
            else:
                p0 = w0.to(dt)
                if mode == MASTER_FP32:
                    self.masters.append(with_layout(w0, state_layout))
                elif mode in (MASTER_REMAINDER, MASTER_REMAINDER8):  # unused: must stay as it is
                    idt, lim = (torch.int16, 2**15) if mode == MASTER_REMAINDER else (torch.int8, 2**7)
                    self.masters.append(with_layout(torch.randint(
                        -lim, lim, shape, device=DEV, dtype=idt), state_layout))
            self.params.append(with_layout(p0, layout))
            g = torch.randn(shape, device=DEV) * (grad_scale or 1.0)
            self.grads.append(with_layout(g.to(dt), layout))
            self.m.append(with_layout(torch.randn(shape, device=DEV) * 0.1, state_layout))
            v = torch.rand(shape, device=DEV) * 0.01
            self.v.append(with_layout(v, state_layout))
            if amsgrad:
                self.vmax.append(with_layout(v + torch.rand(shape, device=DEV) * 0.01,
                                             state_layout))
        n = len(self.params)
        self.steps = [scalar(float((3 * i) % 7)) for i in range(n)]
        lr = 1e-3
        self.lr = lr
        self.lr_tensor = {"float": None, "cuda32": scalar(lr), "cuda64": scalar(lr, torch.float64),
                          "cpu": torch.tensor(lr)}[lr_kind]
        self.hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
                          amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
        self.grad_scale = None if grad_scale is None else scalar(grad_scale)
        self.found_inf = scalar(0.0)
        self.norm_sq, self.max_grad_norm = None, 0.0
        if clip:
            total = sum(float((g.double() / (grad_scale or 1.0)).pow(2).sum()) for g in self.grads)
            self.norm_sq, self.max_grad_norm = scalar(total), 0.3 * math.sqrt(total)
        self.seed = 1234

    def lists(self):
        return [self.params, self.grads, self.m, self.v, self.vmax, self.masters, self.steps]

    def args(self, lists):
        """adam_step_'s operands: the lists."""
        return tuple(lists)

    def kwargs(self, mode=None):
        """adam_step_'s keyword arguments."""
        return dict(lr=self.lr, lr_tensor=self.lr_tensor, **self.hyper,
                    master_mode=self.mode if mode is None else mode, grad_scale=self.grad_scale,
                    found_inf=self.found_inf, norm_sq=self.norm_sq,
                    max_grad_norm=self.max_grad_norm, seed=self.seed)

    def step_and_compare(self):
        ref = [clones(x) for x in self.lists()]
        before = [clones(x) for x in self.lists()]
        native("adam_step_", *self.args(self.lists()), **self.kwargs())
        ref_adam.adam_step_(*self.args(ref), **self.kwargs())
        # fp16 params ignore the remainder/stochastic modes (effective_master_mode): round to
        # nearest.
        ref16 = None
        if self.mode in (MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8):
            ref16 = [clones(x) for x in before]
            ref_adam.adam_step_(*self.args(ref16), **self.kwargs(mode=MASTER_NONE))
        P, G, M, V, VM, MA, S = range(7)
        nat = self.lists()
        for i, p in enumerate(self.params):
            r = ref16 if (ref16 is not None and p.dtype == torch.float16) else ref
            assert torch.equal(self.grads[i], before[G][i]), "grads must not change"
            assert_close(p, r[P][i], p.dtype)
            assert_close(nat[M][i], r[M][i])
            assert_close(nat[V][i], r[V][i])
            if self.amsgrad:
                assert_close(nat[VM][i], r[VM][i])
            if self.masters:
                if self.mode == MASTER_REMAINDER and p.dtype == torch.bfloat16:
                    assert_close(ref_adam.remainder_join(p, self.masters[i]),
                                 ref_adam.remainder_join(r[P][i], r[MA][i]))
                elif self.mode == MASTER_REMAINDER8 and p.dtype == torch.bfloat16:
                    assert_close(ref_adam.remainder8_join(p, self.masters[i]),
                                 ref_adam.remainder8_join(r[P][i], r[MA][i]), **REMAINDER8_TOL)
                elif self.masters[i].dtype in (torch.int16, torch.int8):
                    assert torch.equal(self.masters[i], before[MA][i])
                else:
                    assert_close(self.masters[i], r[MA][i])
            assert torch.equal(self.steps[i], r[S][i])
            assert self.steps[i].item() == before[S][i].item() + 1


def run_adam(case, nsteps=3):
    # Each step compares one application from the same state (the reference copies are taken
    # from the kernel's state every step), so fp32 rounding differences never accumulate.
    for _ in range(nsteps):
        case.step_and_compare()


ADAM_SHAPES = [1, 3, 4, 17, 1000, 4097, 65536, 65537 + 2, 0, 150_003]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_adam_matches_reference(dtype, mode, amsgrad):
    case = AdamCase(ADAM_SHAPES, dtype_cycle(dtype, len(ADAM_SHAPES), mode), mode,
                    amsgrad=amsgrad, decoupled=not amsgrad, maximize=amsgrad)
    run_adam(case)


@pytest.mark.parametrize("lr_kind", ["float", "cuda32", "cuda64", "cpu"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("grad_scale", [None, 1024.0])
def test_adam_device_scalars(grad_scale, clip, lr_kind):
    case = AdamCase(ADAM_SHAPES, dtype_cycle(MIXED, len(ADAM_SHAPES)), MASTER_FP32,
                    grad_scale=grad_scale, clip=clip, lr_kind=lr_kind)
    run_adam(case, nsteps=2)


@pytest.mark.parametrize("state_layout_same", [False, True])
@pytest.mark.parametrize("layouts", [("offset",), ("strided",), ("transposed",),
                                     ("contig", "offset", "strided", "transposed")], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_adam_noncontiguous(mode, layouts, state_layout_same):
    shapes = [(37, 129), (300, 257), (1, 5), (0, 4), (1030, 70), (2, 3)]
    case = AdamCase(shapes, dtype_cycle(MIXED, len(shapes), mode), mode, layouts=layouts,
                    state_layout_same=state_layout_same)
    strides = [p.stride() for p in case.params]
    run_adam(case, nsteps=2)
    assert [p.stride() for p in case.params] == strides


@pytest.mark.parametrize("mode", [MASTER_FP32, MASTER_STOCHASTIC, MASTER_REMAINDER8])
def test_adam_many_small_tensors(mode):
    shapes = torch.randint(0, 200, (400,)).tolist()  # several launches (54 tensors per launch)
    case = AdamCase(shapes, dtype_cycle(MIXED, len(shapes), mode), mode, amsgrad=True)
    run_adam(case, nsteps=2)


@pytest.mark.parametrize("found", [1.0, 2.0, float("inf")])
@pytest.mark.parametrize("grad_scale", [None, 1024.0])
def test_adam_skips_on_found_inf(found, grad_scale):
    case = AdamCase(ADAM_SHAPES, dtype_cycle(MIXED, len(ADAM_SHAPES)), MASTER_FP32,
                    amsgrad=True, grad_scale=grad_scale, clip=True)
    case.found_inf.fill_(found)
    before = [clones(x) for x in case.lists()]
    native("adam_step_", *case.args(case.lists()), **case.kwargs())
    for new, old in zip(case.lists(), before):
        for a, b in zip(new, old):
            assert torch.equal(a, b), "a found_inf step must change nothing (steps included)"


@pytest.mark.parametrize("layout", ["contig", "transposed"])
def test_adam_stochastic_rounding_stream_matches_reference_bitwise(layout):
    # Same stream (seed, packed tensor index, LOGICAL element index, step) as the reference: a
    # wrong stream flips ~1/3 of the roundings, each by one ulp, which the bf16 tolerance cannot
    # see; with the right one only fp32-vs-float64 ties differ (~1e-5 of the elements).
    shapes = [(50, 100), (0, 3), (233, 301), (3, 11)]
    case = AdamCase(shapes, [torch.bfloat16] * 4, MASTER_STOCHASTIC, weight_decay=0.0,
                    layouts=(layout,), state_layout_same=True)
    ref = [clones(x) for x in case.lists()]
    native("adam_step_", *case.args(case.lists()), **case.kwargs())
    ref_adam.adam_step_(*case.args(ref), **case.kwargs())
    for p, r in zip(case.params, ref[0]):
        if p.numel():
            assert (p.view(torch.int16) != r.view(torch.int16)).double().mean().item() < 1e-3


def test_adam_errors():
    case = AdamCase([10, 20], [torch.bfloat16] * 2, MASTER_FP32)
    lists = case.lists()
    bad_steps = [s.double() for s in case.steps]
    with pytest.raises(RuntimeError, match="steps"):
        OPS["adam_step_"](*case.args(lists[:6] + [bad_steps]), **case.kwargs(), backend="native")
    with pytest.raises(RuntimeError, match="master"):
        OPS["adam_step_"](*case.args(lists[:5] + [[]] + lists[6:]), **case.kwargs(),
                          backend="native")
    case.grad_scale = torch.tensor(2.0)  # on the CPU
    with pytest.raises(RuntimeError, match="grad_scale"):
        OPS["adam_step_"](*case.args(lists), **case.kwargs(), backend="native")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 40 * 2**30,
                    reason="needs 40 GB of free GPU memory (uses ~26 GB)")
def test_adam_beyond_int32_elements():
    n = 2**31 + 777
    p = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    g = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    m = torch.zeros(n, device=DEV)
    v = torch.zeros(n, device=DEV)
    tail = slice(2**31 - 300, n)
    p[tail] = torch.randn(n - (2**31 - 300), device=DEV).bfloat16()
    g[tail] = torch.randn(n - (2**31 - 300), device=DEV).bfloat16()
    sp, sg, sm, sv = p[tail].clone(), g[tail].clone(), m[tail].clone(), v[tail].clone()
    step = scalar(0.0)
    kwargs = dict(lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  amsgrad=False, maximize=False, decoupled=True, master_mode=MASTER_NONE,
                  grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0)
    native("adam_step_", [p], [g], [m], [v], [], [], [step], **kwargs)
    ref_adam.adam_step_([sp], [sg], [sm], [sv], [], [], [scalar(0.0)], **kwargs)
    assert_close(p[tail], sp)
    assert_close(m[tail], sm)
    assert_close(v[tail], sv)
    assert step.item() == 1.0
    del p, g, m, v
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# CUDA graph: unscale_grads_ + adam_step_ + update_scale_ captured once, replayed
# ---------------------------------------------------------------------------------------------

def test_cuda_graph_capture():
    shapes = [1000, 65537, 3, 4096]
    dts = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    case = AdamCase(shapes, dts, MASTER_FP32, amsgrad=False)
    scale, gt, ht = scalar(2.0**10), scalar(0, torch.int32), scalar(2, torch.int32)
    found, inv, norm_sq = scalar(0.0), scalar(0.0), scalar(0.0)
    upd = update_kw(2.0, 0.5, 2, 2, 1.0, 2.0**24)

    def pipeline(st, ops):
        unscale, adam, update = ops
        st["found"].zero_()
        st["norm"].zero_()
        st["inv"].copy_(st["scale"].double().reciprocal().float())
        unscale(st["grads"], st["found"], st["inv"], norm_sq=st["norm"])
        adam(*st["case"].args(st["lists"])[:7], lr=st["case"].lr, lr_tensor=None, beta1=0.9,
             beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
             decoupled=True, master_mode=MASTER_FP32, grad_scale=None, found_inf=st["found"],
             norm_sq=st["norm"], max_grad_norm=1.0, seed=7)
        update(st["scale"], st["gt"], st["ht"], st["found"], **upd)

    native_ops = (lambda *a, **k: OPS["unscale_grads_"](*a, **k, backend="native"),
                  lambda *a, **k: OPS["adam_step_"](*a, **k, backend="native"),
                  lambda *a, **k: OPS["update_scale_"](*a, **k, backend="native"))
    ref_ops = (ref_amp.unscale_grads_, ref_adam.adam_step_, ref_amp.update_scale_)

    static = dict(case=case, lists=case.lists(), grads=case.grads, found=found, inv=inv,
                  norm=norm_sq, scale=scale, gt=gt, ht=ht)
    keys = ("found", "inv", "norm", "scale", "gt", "ht")
    snapshot = [clones(x) for x in case.lists()] + [[static[k].clone() for k in keys]]

    def restore():
        for dst, src in zip(case.lists() + [[static[k] for k in keys]], snapshot):
            for a, b in zip(dst, src):
                a.copy_(b)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (lazy module loading etc.)
        pipeline(static, native_ops)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    restore()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pipeline(static, native_ops)
    restore()  # capture does not run the kernels, but keep the start state explicit

    for it in range(5):
        new_grads = [(torch.randn(g.shape, device=DEV) * scale.item()).to(g.dtype)
                     for g in case.grads]
        if it == 2:
            new_grads[1][7] = float("inf")  # this iteration must skip and back off
        for g, ng in zip(case.grads, new_grads):
            g.copy_(ng)
        ref_lists = [clones(x) for x in case.lists()]
        ref = dict(case=case, lists=ref_lists, grads=ref_lists[1],
                   **{k: static[k].clone() for k in keys})
        before_params = clones(case.params)
        before_steps = [s.item() for s in case.steps]
        graph.replay()
        pipeline(ref, ref_ops)
        torch.cuda.synchronize()
        assert found.item() == ref["found"].item() == (1.0 if it == 2 else 0.0)
        for k in ("scale", "gt", "ht"):
            assert torch.equal(static[k], ref[k]), k
        torch.testing.assert_close(norm_sq, ref["norm"], **NORM_TOL)
        for i, p in enumerate(case.params):
            if it == 2:
                assert torch.equal(p, before_params[i])
                assert case.steps[i].item() == before_steps[i]
            else:
                assert_close(p, ref_lists[0][i], p.dtype)
                assert_close(case.masters[i], ref_lists[5][i])
                assert_close(case.m[i], ref_lists[2][i])
                assert_close(case.v[i], ref_lists[3][i])
                assert case.steps[i].item() == before_steps[i] + 1
            assert torch.equal(case.steps[i], ref_lists[6][i])


# ---------------------------------------------------------------------------------------------
# opcheck on CUDA
# ---------------------------------------------------------------------------------------------

def test_opcheck_amp():
    grads = make_grads([5, (3, 4), 0, 70000], MIXED, ("contig", "transposed"))
    per = torch.zeros(len(grads), device=DEV)
    for op in ("unscale_grads_", "check_grads"):
        torch.library.opcheck(OPS[op].overload, (grads, scalar(0.0), scalar(0.5)),
                              dict(norm_sq=scalar(0.0), norm_sq_per_tensor=per))
    torch.library.opcheck(OPS["update_scale_"].overload,
                          (scalar(2.0**16), scalar(0, torch.int32), scalar(1, torch.int32),
                           scalar(1.0)), update_kw(2.0, 0.5, 3, 1, 0.0, math.inf))


@pytest.mark.parametrize("mode", [MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8])
def test_opcheck_adam(mode):
    case = AdamCase([7, (4, 3), 0, 1000], dtype_cycle(MIXED, 4, mode), mode, amsgrad=True,
                    grad_scale=8.0, clip=True, lr_kind="cuda32")
    torch.library.opcheck(OPS["adam_step_"].overload, case.args(case.lists()), case.kwargs())
