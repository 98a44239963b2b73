"""Per-tensor scalars of an Adam(W) step, shared by the Triton Adam kernels
(csrc/include/mpfused/adam_math.h::adam_scalars): every constant torch derives in double (1 - beta1,
1 - beta2, lr * weight_decay, the bias-corrected step size, 1 / sqrt(1 - beta2^t)) derived in fp64
and rounded to fp32 once; beta2 and eps as fp32; the gradient multiplier (unscale, clip,
maximize) and the step number t from _step_scalars. Read on the device: nothing here syncs with
the host."""
import triton
import triton.language as tl

from mpfused.triton_kernels._bits import f64_from_bits
from mpfused.triton_kernels._step_scalars import grad_multiplier, read_lr, step_number


@triton.jit
def adam_scalars(step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, eps,
                 wd_bits, mgn_bits, HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_NORM: tl.constexpr, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr):
    # Float arguments are fp32 when compiled but Python floats (doubles) under the interpreter:
    # fp64 values travel as bit patterns (_bits.f64_bits), eps is rounded to fp32 explicitly, so
    # both see the CPU kernel's values.
    lr64 = read_lr(lr_ptr, lr_bits, HAS_LR)
    x1 = f64_from_bits(beta1_bits)  # the fp64 betas, exactly
    x2 = f64_from_bits(beta2_bits)
    wd64 = f64_from_bits(wd_bits)
    b2 = x2.to(tl.float32)
    one_m_b1 = (1.0 - x1).to(tl.float32)
    one_m_b2 = (1.0 - x2).to(tl.float32)
    eps32 = tl.full((), eps, tl.float32)
    # t = step + 1; beta^t in fp64 by binary exponentiation (libdevice pow does not exist in the
    # interpreter): a few fp64 ulps from C's pow, far below the fp32 rounding that follows.
    ti = step_number(step_ptr).to(tl.int64)
    e = ti
    pw1 = tl.full((), 1.0, tl.float64)
    pw2 = tl.full((), 1.0, tl.float64)
    while e > 0:
        odd = (e & 1) == 1
        pw1 = tl.where(odd, pw1 * x1, pw1)
        pw2 = tl.where(odd, pw2 * x2, pw2)
        x1 = x1 * x1
        x2 = x2 * x2
        e = e >> 1
    step_size = (lr64 / (1.0 - pw1)).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.sqrt(1.0 - pw2)).to(tl.float32)
    gm = grad_multiplier(scale_ptr, norm_ptr, mgn_bits, HAS_SCALE, HAS_NORM, MAXIMIZE)
    if DECOUPLED:
        decay = (lr64 * wd64).to(tl.float32)
        l2 = tl.full((), 0.0, tl.float32)
    else:
        decay = tl.full((), 0.0, tl.float32)
        l2 = wd64.to(tl.float32)
    return ti, b2, eps32, one_m_b1, one_m_b2, step_size, inv_bc2_sqrt, gm, decay, l2
