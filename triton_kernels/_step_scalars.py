"""Per-tensor scalars that every Triton optimizer step reads on the device (nothing here syncs with
the host): the step number t, lr (a tensor lr or an fp64 argument) and the gradient multiplier
(unscale, clip, maximize), as the native kernels form them before calling adam_scalars,
sgd_scalars or lion_scalars (csrc/include/mpfused/*_math.h)."""
import triton
import triton.language as tl

from mpfused.triton_kernels._bits import f64_from_bits


@triton.jit
def step_number(step_ptr):
    """t = step counter + 1 (the step being taken), in fp64 as the kernels' `double t`."""
    return tl.load(step_ptr).to(tl.float64) + 1.0


@triton.jit
def read_lr(lr_ptr, lr_bits, HAS_LR: tl.constexpr):
    """lr in fp64: a tensor lr is read as its fp32 value (as the native kernels read it), else the
    fp64 argument, which travels as a bit pattern (_bits.f64_bits)."""
    if HAS_LR:
        lr64 = tl.load(lr_ptr).to(tl.float32).to(tl.float64)
    else:
        lr64 = f64_from_bits(lr_bits)
    return lr64


@triton.jit
def grad_multiplier(scale_ptr, norm_ptr, mgn_bits, HAS_SCALE: tl.constexpr,
                    HAS_NORM: tl.constexpr, MAXIMIZE: tl.constexpr):
    """fp32 1/grad_scale times the fp64 clip coefficient rounded to fp32, negated for maximize."""
    gm = tl.full((), 1.0, tl.float32)
    if HAS_SCALE:
        gm = tl.div_rn(gm, tl.load(scale_ptr).to(tl.float32))
    if HAS_NORM:
        # fp64 as the CPU kernel: max_grad_norm / (sqrt(norm_sq) + 1e-6), std::min(1.0, q),
        # rounded to fp32.
        mgn = f64_from_bits(mgn_bits)
        norm = tl.sqrt(tl.load(norm_ptr).to(tl.float32).to(tl.float64))
        q = mgn / (norm + 1e-6)
        clip = tl.where(q < 1.0, q, 1.0)  # std::min(1.0, q): NaN gives 1
        gm = gm * clip.to(tl.float32)
    if MAXIMIZE:
        gm = -gm
    return gm
