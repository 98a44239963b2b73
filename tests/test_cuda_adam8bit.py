"""Native CUDA adam8bit_step_ (csrc/cuda/adam8bit_cuda.cu via csrc/bindings/adam8bit_ops_cuda.cpp)
against mpfused.reference.adam8bit; bit for bit against the native CPU kernel, skips, errors, graphs
and opcheck: tests/test_cuda_adam8bit_contract.py (same helpers).

Every native CUDA call runs under torch.cuda.set_sync_debug_mode("error"): the CUDA path never
synchronizes with the host. Reference comparisons are single applications from the same state:
codes equal except where a moment lies within fp32 rounding of a decision threshold (then one
code apart), absmax equal to fp32 rounding, params within the per-dtype tolerance. The native
CPU kernel runs the same fp32 operations in the same order (no FMA contraction on either side,
IEEE division and square root), so CPU and CUDA agree exactly. Skipped without a GPU, or when the
extension was built without its CUDA kernels (tests/test_cuda_emulation.py runs the unchanged
kernel on the host instead, byte for byte against the CPU kernel)."""
import contextlib
import math

import pytest
import torch

from mpfused import _extension, quant4
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.reference import adam as ref_adam
from mpfused.reference import adam4bit as ref4
from mpfused.reference import adam8bit as ref8
from tests.tolerances import REMAINDER8_TOL, assert_close

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _extension.with_cuda(),
                       reason="mpfused extension built without its CUDA kernels"),
]

DEV = "cuda"
OP = "adam8bit_step_"
OPS_BY_BITS = {8: OP, 4: "adam4bit_step_"}  # the same kernel, code width 8 or 4 (test_cuda_adam4bit.py)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIXED = "mixed"
MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8 = 0, 1, 2, 3, 4
MODES = [MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8]
P, G, C1, C2, A1, A2, MA, S = range(8)  # positions of the tensor lists in the op's arguments
# sizes: tails of every kind, whole and partial 4096-element CUDA chunks, an empty tensor
SIZES = [1, 3, 64, 65, 255, 4095, 4096, 4097, 8192 + 77, 0, 65536 + 129, 150_003]
# absmax against the float64 reference: fp32 rounding for exp_avg; for exp_avg_sq, the kernels
# (as torch's fused ones) use fp32 betas, and fp32 (1 - 0.999) is 1.3e-5 off: a v made mostly of
# its (1 - beta2) g^2 term (the first step) is off by that much. The CPU comparison is exact.
ABSMAX_RTOL = {A1: 1e-6, A2: 2e-5}


@contextlib.contextmanager
def no_host_sync():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def native(*args, op=OP, **kwargs):
    with no_host_sync():
        OPS[op](*args, **kwargs, backend="native")


def scalar(x, dtype=torch.float32, device=DEV):
    return torch.tensor(x, dtype=dtype, device=device)


def with_layout(x, layout):
    """x's values laid out as asked: contig; offset (1 element past an aligned address: the
    kernel's element-wise path); strided (every other element: staged by the binding); transposed
    (2-D, dense but not contiguous: staged)."""
    shape = tuple(x.shape)
    kw = {"dtype": x.dtype, "device": x.device}
    if layout == "contig":
        out = torch.empty(shape, **kw)
    elif layout == "offset":
        out = torch.empty(x.numel() + 1, **kw)[1:].view(shape)
    elif layout == "strided":
        out = torch.empty(shape[:-1] + (2 * shape[-1],), **kw)[..., ::2]
    elif layout == "transposed":
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


def clone_lists(lists, device=None):
    return [[t.to(device) if device else t.clone() for t in lst] for lst in lists]


def maps(bits, device):
    """The (signed, unsigned) maps of a code width: bitsandbytes' 256-entry ones, torchao's 16."""
    if bits == 4:
        return quant4.signed4_map(device), quant4.unsigned4_map(device)
    return qm.signed_map(device), qm.unsigned_map(device)


class Q8Case:
    """One adam8bit_step_ call (bits=4: adam4bit_step_): 8-bit (4-bit packed) state quantized from
    random fp32 moments, on the GPU. 4-bit codes are contiguous (the op's rule): laid out "offset"
    (one byte past an aligned start) where the params are, else contiguous."""

    def __init__(self, shapes, dtypes, mode, block=256, layouts=("contig",), grad_scale=None,
                 clip=False, lr_kind="float", maximize=False, decoupled=True, weight_decay=0.01,
                 fresh=False, bits=8):
        self.mode, self.block, self.bits = mode, block, bits
        self.op = OPS_BY_BITS[bits]
        self.qmap1, self.qmap2 = maps(bits, DEV)
        quantize = quant4.quantize4_blockwise if bits == 4 else qm.quantize_blockwise
        self.params, self.grads, self.c1, self.c2, self.a1, self.a2, self.masters = ([] for _ in range(7))
        for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            layout = layouts[i % len(layouts)]
            if layout == "transposed" and len(shape) != 2:
                layout = "contig"
            w0 = torch.randn(shape, device=DEV) * 0.5
            if mode == MASTER_REMAINDER and dt == torch.bfloat16:
                p0, rem = ref_adam.remainder_split(w0.contiguous())
                self.masters.append(with_layout(rem, layout))
            elif mode == MASTER_REMAINDER8 and dt == torch.bfloat16:
                p0, rem = ref_adam.remainder8_split(w0.contiguous())
                self.masters.append(with_layout(rem, layout))
            else:
                p0 = w0.to(dt)
                if mode == MASTER_FP32:
                    self.masters.append(with_layout(w0, layout))
                elif mode in (MASTER_REMAINDER, MASTER_REMAINDER8):  # unused: must stay as it is
                    idt, lim = (torch.int16, 2**15) if mode == MASTER_REMAINDER else (torch.int8, 2**7)
                    self.masters.append(with_layout(torch.randint(
                        -lim, lim, shape, device=DEV, dtype=idt), layout))
            self.params.append(with_layout(p0, layout))
            # bitsandbytes-like magnitudes: the g^2 term is a small part of v (see ABSMAX_RTOL)
            g = torch.randn(shape, device=DEV) * 0.01 * (grad_scale or 1.0)
            self.grads.append(with_layout(g.to(dt), layout))
            m = torch.zeros(shape, device=DEV) if fresh else torch.randn(shape, device=DEV) * 1e-3
            v = torch.zeros(shape, device=DEV) if fresh else torch.rand(shape, device=DEV) * 1e-5
            c1, a1 = quantize(m, self.qmap1, block)
            c2, a2 = quantize(v, self.qmap2, block)
            code_layout = layout if bits == 8 else ("offset" if layout == "offset" else "contig")
            self.c1.append(with_layout(c1, code_layout))
            self.c2.append(with_layout(c2, code_layout))
            self.a1.append(a1)
            self.a2.append(a2)
        self.steps = [scalar(float((3 * i) % 7)) for i in range(len(self.params))]
        self.lr = 1e-3
        self.lr_tensor = {"float": None, "cuda32": scalar(self.lr),
                          "cuda64": scalar(self.lr, torch.float64),
                          "cpu": torch.tensor(self.lr)}[lr_kind]
        self.hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
                          maximize=maximize, decoupled=decoupled)
        self.grad_scale = None if grad_scale is None else scalar(grad_scale)
        self.found_inf = scalar(0.0)
        self.norm_sq, self.max_grad_norm = None, 0.0
        if clip:
            total = sum(float((g.double() / (grad_scale or 1.0)).pow(2).sum()) for g in self.grads)
            self.norm_sq, self.max_grad_norm = scalar(total), 0.3 * math.sqrt(total)
        self.seed = 1234

    def lists(self):
        return [self.params, self.grads, self.c1, self.c2, self.a1, self.a2, self.masters,
                self.steps]

    def args(self, lists, device=None):
        """adam8bit_step_'s operands: the lists and the two maps."""
        q1, q2 = (self.qmap1, self.qmap2) if device is None else maps(self.bits, device)
        return (*lists, q1, q2)

    def kwargs(self, mode=None, device=None):
        """adam8bit_step_'s keyword arguments."""
        h = self.hyper

        def on(t):
            return t if t is None or device is None else t.to(device)

        return dict(block_size=self.block, lr=self.lr, lr_tensor=on(self.lr_tensor),
                    beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                    weight_decay=h["weight_decay"], maximize=h["maximize"],
                    decoupled=h["decoupled"], master_mode=self.mode if mode is None else mode,
                    grad_scale=on(self.grad_scale), found_inf=on(self.found_inf),
                    norm_sq=on(self.norm_sq), max_grad_norm=self.max_grad_norm, seed=self.seed)

    def step_and_compare(self):
        """One native step against the reference (run from the same state)."""
        before = clone_lists(self.lists())
        ref = clone_lists(self.lists())
        reference = ref4.adam4bit_step_ if self.bits == 4 else ref8.adam8bit_step_
        native(*self.args(self.lists()), op=self.op, **self.kwargs())
        reference(*self.args(ref), **self.kwargs())
        # fp16 params ignore the remainder/stochastic modes (effective_master_mode): round to
        # nearest.
        ref16 = None
        if self.mode in (MASTER_REMAINDER, MASTER_STOCHASTIC, MASTER_REMAINDER8):
            ref16 = clone_lists(before)
            reference(*self.args(ref16), **self.kwargs(mode=MASTER_NONE))
        nat = self.lists()
        for i, p in enumerate(self.params):
            r = ref16 if (ref16 is not None and p.dtype == torch.float16) else ref
            assert torch.equal(self.grads[i], before[G][i]), "grads must not change"
            assert_close(p, r[P][i], p.dtype)
            for k in (C1, C2):
                if self.bits == 4:
                    assert_codes_close(quant4.unpack4(nat[k][i], p.numel()),
                                       quant4.unpack4(r[k][i], p.numel()))
                else:
                    assert_codes_close(nat[k][i], r[k][i])
            for k in (A1, A2):
                assert_absmax_close(nat[k][i], r[k][i], before[k][i], k)
            if self.masters:
                if self.mode == MASTER_REMAINDER and p.dtype == torch.bfloat16:
                    assert_close(ref_adam.remainder_join(p, self.masters[i]),
                                 ref_adam.remainder_join(r[P][i], r[MA][i]))
                elif self.mode == MASTER_REMAINDER8 and p.dtype == torch.bfloat16:
                    assert_close(ref_adam.remainder8_join(p, self.masters[i]),
                                 ref_adam.remainder8_join(r[P][i], r[MA][i]), **REMAINDER8_TOL)
                elif self.masters[i].dtype in (torch.int16, torch.int8) or p.dtype == torch.float32:
                    assert torch.equal(self.masters[i], before[MA][i]), "unused master written"
                else:
                    assert_close(self.masters[i], r[MA][i])
            assert torch.equal(self.steps[i], r[S][i])
            assert self.steps[i].item() == before[S][i].item() + 1


def assert_codes_close(got, exp):
    """Codes one apart where a moment lies within rounding of a decision threshold, never more.
    The kernels update in fp32 with fp32 betas, the reference in float64: m differs by ulps, v by
    up to 1.3e-5 relative (fp32 1 - beta2), which flips ~1e-3 of the v codes (measured with the
    CPU kernel: at most 0.08% of a 150k-element tensor)."""
    diff = (got.int() - exp.int()).abs()
    assert int((diff > 1).sum()) == 0, "codes more than one apart"
    assert int((diff > 0).sum()) <= 2 + exp.numel() // 500, int((diff > 0).sum())


def assert_absmax_close(got, exp, old, k):
    """ABSMAX_RTOL of the new absmax, or of the old one: a block of a few elements may hold only
    a moment that nearly cancels (m + (1 - beta1) (g - m)), whose fp32 value is off by ulps of
    its terms, not of itself."""
    scale = float(old.abs().max()) if old.numel() else 0.0
    torch.testing.assert_close(got, exp, rtol=ABSMAX_RTOL[k], atol=ABSMAX_RTOL[k] * scale)


def assert_lists_equal(a, b, what=""):
    for k, (la, lb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(la, lb)):
            x, y = x.cpu(), y.cpu()
            if x.dtype.is_floating_point:  # bit patterns: NaN == NaN, -0 != +0
                x = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
                y = y.view(torch.int16 if y.element_size() == 2 else torch.int32)
            assert torch.equal(x, y), f"{what}list {k}, tensor {i}"


# ---- against the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("block", [64, 256, 2048, 4096])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES + [MIXED], ids=str)
def test_matches_reference(dtype, mode, block):
    case = Q8Case(SIZES, dtype_cycle(dtype, len(SIZES), mode), mode, block=block,
                  maximize=block == 2048, decoupled=block != 64)
    for _ in range(2):  # the second step starts from the kernel's own 8-bit state
        case.step_and_compare()


def test_first_step_from_zero_state():
    case = Q8Case(SIZES, dtype_cycle(MIXED, len(SIZES)), MASTER_FP32, fresh=True)
    case.step_and_compare()


@pytest.mark.parametrize("lr_kind", ["float", "cuda32", "cuda64", "cpu"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("grad_scale", [None, 1024.0])
def test_device_scalars(grad_scale, clip, lr_kind):
    case = Q8Case(SIZES, dtype_cycle(MIXED, len(SIZES)), MASTER_FP32, grad_scale=grad_scale,
                  clip=clip, lr_kind=lr_kind)
    case.step_and_compare()


@pytest.mark.parametrize("layouts", [("offset",), ("strided",), ("transposed",),
                                     ("contig", "offset", "strided", "transposed")], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_noncontiguous_and_misaligned(mode, layouts):
    shapes = [(37, 129), (300, 257), (1, 5), (0, 4), (1030, 70), (2, 3), (64, 65)]
    case = Q8Case(shapes, dtype_cycle(MIXED, len(shapes), mode), mode, layouts=layouts)
    strides = [p.stride() for p in case.params]
    case.step_and_compare()
    assert [p.stride() for p in case.params] == strides


def test_many_small_tensors():
    shapes = torch.randint(0, 600, (300,)).tolist()  # several launches (48 tensors per launch)
    case = Q8Case(shapes, dtype_cycle(MIXED, len(shapes)), MASTER_STOCHASTIC)
    case.step_and_compare()
