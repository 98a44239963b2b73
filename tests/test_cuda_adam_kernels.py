"""Native CUDA adam_step_ (csrc/cuda/adam_cuda.cu via csrc/bindings) against mpfused.reference, and
the CUDA graph of unscale_grads_ + adam_step_ + update_scale_; the method, the helpers and the
skips are tests/test_cuda_kernels.py's (moved from there)."""
import math

import pytest
import torch

from mpfused.ops import OPS
from mpfused.reference import adam as ref_adam
from mpfused.reference import amp as ref_amp
from tests.test_cuda_kernels import (DEV, DTYPES, MASTER_FP32, MASTER_NONE, MASTER_REMAINDER,
                                     MASTER_REMAINDER8, MASTER_STOCHASTIC, MIXED, MODES, NORM_TOL,
                                     clones, dtype_cycle, native, scalar, update_kw, with_layout)
from tests.test_cuda_kernels import pytestmark  # noqa: F401  (its skips: no GPU, no CUDA build)
from tests.tolerances import REMAINDER8_TOL, assert_close


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


@pytest.mark.parametrize("mode", [MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8])
def test_opcheck_adam(mode):
    case = AdamCase([7, (4, 3), 0, 1000], dtype_cycle(MIXED, 4, mode), mode, amsgrad=True,
                    grad_scale=8.0, clip=True, lr_kind="cuda32")
    torch.library.opcheck(OPS["adam_step_"].overload, case.args(case.lists()), case.kwargs())
