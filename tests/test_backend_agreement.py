"""The Triton kernels (interpreter) against the native CPU kernels, end to end through the
optimizers: params, masters, remainders, moments, 8-bit codes and absmax, and step counts must be
bit-identical after several steps, over param dtypes x master modes x state kinds, with the
scaler's in-kernel unscale, fused clipping, amsgrad, L2 / decoupled decay and an inf step.
The per-element math is written once per language (csrc/include/mpfused/*.h, triton_kernels/
_adam_scalars.py + _bits.py); this pins the two together (issue 21, point 3).

The one allowed difference, stated and counted: a sum of squares (the clipping norm of the check
op) is reduced in another order by the two backends (CPU: per 4096-element chunk, then the
chunks in order; Triton: per program block, then the blocks), so the fp32 norm_sq may differ in
its last bits (measured: 1 ulp in 8 of 40 random inputs of the 4 small tensors below; with a
5000-element tensor added, at most 2 / 4 / 6 ulps for fp32 / fp16 / bf16 grads over 60 inputs;
two summation orders of n terms can differ by up to ~n ulps in the worst case, so the budget,
NORM_ULP_BUDGET = 16 ulps, is ~1e-6 relative: far below any effect on clipping). Everything
downstream of a different norm differs too, so the optimizer comparison takes the norm from one
check backend
(the scaler's ``backend="native"``) and the check op is compared on its own with that budget.

SGD and Lion are compared through their optimizers (a few cases above) and op by op (sgd_step_,
lion_step_ over the named cases of tests/test_sgd_lion_kernels.py; sgd8bit_step_, lion8bit_step_ over
the named step cases of tests/sgd_lion_quant_cases.py), skipped while the extension has no native
CPU kernel for them."""
import pytest
import torch

import mpfused
from mpfused.ops import OPS
from tests import sgd_lion_quant_harness as Q
from tests import test_sgd_lion_kernels as SL
from tests.sgd_lion_quant_cases import STEP_CASES, case_state

pytestmark = pytest.mark.skipif(
    not (OPS["adam_step_"].native_available("cpu") and "triton" in OPS["adam_step_"].available("cpu")),
    reason="needs the native CPU kernels and the Triton interpreter")

SHAPES = ((37, 11), (300,), (2, 3, 5), (1,))  # odd sizes, a vector, a 3-d tensor, one element
CASES = {
    # id: (optimizer class, param dtype, optimizer kwargs)
    "fp32": (mpfused.AdamW, torch.float32, {}),
    "fp32-amsgrad-L2": (mpfused.Adam, torch.float32, {"amsgrad": True, "weight_decay": 0.1}),
    "bf16-fp32-master-clip": (mpfused.AdamW, torch.bfloat16, {"max_grad_norm": 0.05}),
    "bf16-remainder": (mpfused.AdamW, torch.bfloat16, {"master_weights": "remainder"}),
    "bf16-stochastic": (mpfused.AdamW, torch.bfloat16, {"master_weights": "none"}),
    "bf16-remainder8-amsgrad": (mpfused.AdamW, torch.bfloat16,
                                {"master_weights": "remainder8", "amsgrad": True}),
    "fp16-fp32-master": (mpfused.AdamW, torch.float16, {}),
    "fp16-no-master": (mpfused.AdamW, torch.float16, {"master_weights": "none"}),
    "8bit-fp32": (mpfused.AdamW8bit, torch.float32, {"min_8bit_size": 256, "block_size": 64}),
    "8bit-bf16-remainder": (mpfused.AdamW8bit, torch.bfloat16,
                            {"min_8bit_size": 256, "master_weights": "remainder"}),
    "8bit-bf16-remainder8-clip": (mpfused.AdamW8bit, torch.bfloat16,
                                  {"min_8bit_size": 256, "master_weights": "remainder8",
                                   "max_grad_norm": 0.05}),
    "8bit-bf16-stochastic-clip": (mpfused.AdamW8bit, torch.bfloat16,
                                  {"min_8bit_size": 256, "master_weights": "none",
                                   "max_grad_norm": 0.05}),
    "4bit-fp32": (mpfused.AdamW4bit, torch.float32, {"min_8bit_size": 256, "block_size": 64}),
    "4bit-bf16-remainder": (mpfused.AdamW4bit, torch.bfloat16,
                            {"min_8bit_size": 256, "master_weights": "remainder"}),
    "4bit-bf16-remainder8": (mpfused.AdamW4bit, torch.bfloat16,
                             {"min_8bit_size": 256, "master_weights": "remainder8"}),
    "4bit-fp16-stochastic-clip": (mpfused.Adam4bit, torch.float16,
                                  {"min_8bit_size": 256, "max_grad_norm": 0.05,
                                   "weight_decay": 0.1}),
    # SGD and Lion: skipped while their native kernels are not registered (see below)
    "sgd-fp32-nesterov-L2": (mpfused.SGD, torch.float32,
                             {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    "sgd-bf16-remainder-dampening-clip": (mpfused.SGD, torch.bfloat16,
                                          {"momentum": 0.9, "dampening": 0.1, "max_grad_norm": 0.05,
                                           "master_weights": "remainder"}),
    "sgd-bf16-stochastic-no-momentum": (mpfused.SGD, torch.bfloat16, {"master_weights": "none"}),
    "sgd-bf16-remainder8-nesterov": (mpfused.SGD, torch.bfloat16,
                                     {"momentum": 0.9, "nesterov": True,
                                      "master_weights": "remainder8"}),
    "lion-bf16-remainder8": (mpfused.Lion, torch.bfloat16,
                             {"weight_decay": 0.1, "master_weights": "remainder8"}),
    "lion-fp16-fp32-master": (mpfused.Lion, torch.float16, {"weight_decay": 0.1}),
    "lion-bf16-stochastic-clip": (mpfused.Lion, torch.bfloat16,
                                  {"master_weights": "none", "max_grad_norm": 0.05}),
}
STEPS = 3
INF_STEP = 1
NORM_ULP_BUDGET = 16  # fp32 ulps of the check op's sum of squares between backends (see above)


def _run(backend: str, cls, dtype, kwargs, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = cls(params, lr=1e-2, backend=backend, **kwargs)
    # the check (found_inf, clipping norm) from one backend: see the module docstring
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**6, growth_interval=1, backend="native")
    for step in range(STEPS):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 2.0**6).to(dtype)
        if step == INF_STEP:
            params[1].grad[3] = float("inf")
        scaler.scale(torch.ones(()))  # the scale's lazy init, as a scaled loss would do
        scaler.step(opt)
        scaler.update()
    out = {f"param{i}": p.detach() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            out[f"param{i}.{key}"] = value
    out["scale"] = scaler._scale
    return out


def _native_registered(*ops) -> bool:
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"mpfused::{op}", "CPU")
               for op in ops)


NO_SGD_LION_NATIVE = pytest.mark.skipif(
    not _native_registered("sgd_step_", "lion_step_"),
    reason="the native CPU kernels of sgd_step_ / lion_step_ are not registered (not built into "
           "this extension)")
NO_SGD_LION_8BIT_NATIVE = pytest.mark.skipif(
    not _native_registered("sgd8bit_step_", "lion8bit_step_"),
    reason="the native CPU kernels of sgd8bit_step_ / lion8bit_step_ are not registered (not "
           "built into this extension)")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=NO_SGD_LION_NATIVE) if CASES[c][0] in (mpfused.SGD, mpfused.Lion) else c
    for c in CASES])
def test_triton_equals_native_bit_for_bit(case):
    cls, dtype, kwargs = CASES[case]
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs (conftest's seed)
    native = _run("native", cls, dtype, kwargs, seed)
    triton = _run("triton", cls, dtype, kwargs, seed)
    assert native.keys() == triton.keys()
    for key, want in native.items():
        got = triton[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        # bit patterns, so NaN payloads and -0.0 count too
        assert torch.equal(got.view(torch.uint8) if got.dim() else got.reshape(1).view(torch.uint8),
                           want.view(torch.uint8) if want.dim() else want.reshape(1).view(torch.uint8)), (
            f"{case}: {key} differs (seed {seed})")
    if kwargs.get("min_8bit_size"):
        assert any(v.dtype == torch.uint8 for v in native.values()), "no 8-bit state was tested"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_op_agrees_within_the_norm_budget(dtype):
    """found_inf and the unscaled grads bit for bit; norm_sq within one fp32 ulp (the budget)."""
    from mpfused.ops import amp as amp_ops

    import math

    seed = int(torch.randint(0, 2**31, ()).item())
    out = {}
    for backend in ("native", "triton"):
        gen = torch.Generator().manual_seed(seed)
        grads = [(torch.randn(s, generator=gen) * 64).to(dtype) for s in SHAPES + ((5000,),)]
        found, norm_sq = torch.zeros(()), torch.zeros(())
        amp_ops.unscale_grads_(grads, found, torch.tensor(1 / 64.0), norm_sq=norm_sq,
                               norm_sq_per_tensor=None,
                               backend=backend)
        out[backend] = (grads, found, norm_sq)
    (g_n, f_n, n_n), (g_t, f_t, n_t) = out["native"], out["triton"]
    assert torch.equal(f_n, f_t)
    for a, b in zip(g_n, g_t):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    ulp = 2.0 ** (math.frexp(n_n.item())[1] - 24)  # fp32 spacing at the native norm
    assert abs(n_n.item() - n_t.item()) <= NORM_ULP_BUDGET * ulp, (n_n.item(), n_t.item(), seed)


# ---- SGD and Lion op by op over many more option sets: Triton = native bit for bit -----------
@NO_SGD_LION_NATIVE
@pytest.mark.parametrize("case", SL.CASE_PARAMS)
def test_sgd_lion_triton_equals_native_bit_for_bit(case):
    """Every case of tests/test_sgd_lion_kernels.py (dtypes x master modes x options: momentum,
    dampening, Nesterov, L2 / decoupled decay, maximize, tensor lr, unscale, clipping, SR
    streams), STEPS steps from the same state and grads, the INF_STEP-th skipped by found_inf:
    params, masters, remainders, buffers / moments and step counters bit for bit."""
    op = case["op"]
    tri, kw, scale, clip = SL.case_state(case, "cpu")
    nat = SL.clone_state(tri)
    for k in range(STEPS):
        SL.new_grads(tri, scale or 1.0)
        nat["grads"] = [g.clone() for g in tri["grads"]]
        extra = SL.scaler_args(tri, scale, clip)
        if k == INF_STEP:
            extra["found_inf"] = torch.ones(1)
        SL.step(op, tri, "triton", **kw, **extra)
        SL.step(op, nat, "native", **kw, **extra)
        for key in SL.KEYS:
            for i, (a, b) in enumerate(zip(tri[key], nat[key])):
                assert SL.bits_equal(a, b), f"{op} step {k}: {key}[{i}] differs"


# ---- SGD and Lion with an 8-bit state, op by op: Triton = native bit for bit ------------------
@NO_SGD_LION_8BIT_NATIVE
@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in STEP_CASES])
def test_sgd_lion_8bit_triton_equals_native_bit_for_bit(case):
    """Every named step case of tests/sgd_lion_quant_cases.py (dtypes x master modes x options x
    block sizes, partial last blocks, empty tensors), STEPS + 1 steps from the same state and grads:
    codes, absmax, params, masters, remainders and step counters bit for bit. The INF_STEP-th
    step is skipped by found_inf; the last has a NaN grad in the middle of a block (its block's
    absmax becomes NaN: the max over bit patterns, and the codes of a NaN block)."""
    op, tri, kw, run = case_state(case, 8, "cpu")
    scale, clip = run["scale"], run["clip"]
    nat = SL.clone_state(tri)
    big = 3  # the tensor of several blocks (sgd_lion_quant_cases.shapes_for)
    for k in range(STEPS + 1):
        SL.new_grads(tri, scale or 1.0)
        extra = SL.scaler_args(tri, scale, clip)  # clipping from the finite grads
        if k == INF_STEP:
            extra["found_inf"] = torch.ones(1)
        if k == STEPS:
            tri["grads"][big].view(-1)[tri["grads"][big].numel() // 2] = float("nan")
        nat["grads"] = [g.clone() for g in tri["grads"]]
        Q.step(op, tri, "triton", **kw, **extra)
        Q.step(op, nat, "native", **kw, **extra)
        for key in Q.KEYS:
            for i, (a, b) in enumerate(zip(tri[key], nat[key])):
                assert SL.bits_equal(a, b), f"{op} step {k}: {key}[{i}] differs"
    assert torch.isnan(tri["absmaxs"][big]).any()
