"""Per-tensor scalars and the master-mode weight load/store of an Adam(W) step, shared by the
Triton Adam kernels
(csrc/include/mpfused/adam_math.h::adam_scalars): lr, betas, eps as fp32, the bias-corrected step
size, 1 / sqrt(1 - beta2^t), the gradient multiplier (unscale, clip, maximize) and the decoupled /
L2 weight decay, and the step number t. Read on the device: nothing here syncs with the host."""
import triton
import triton.language as tl

from mpfused.triton_kernels._bits import f64_from_bits, load_f32, store_f32


@triton.jit
def adam_scalars(step_ptr, lr_ptr, scale_ptr, norm_ptr, lr, beta1_bits, beta2_bits, eps,
                 weight_decay, mgn_bits, HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_NORM: tl.constexpr, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr):
    # Float arguments are fp32 tensors when compiled but Python floats (doubles) under the
    # interpreter: tl.full rounds them to fp32 explicitly so both see the CPU kernel's values.
    if HAS_LR:
        lr32 = tl.load(lr_ptr).to(tl.float32)
    else:
        lr32 = tl.full((), lr, tl.float32)
    x1 = f64_from_bits(beta1_bits)  # the fp64 betas, exactly (_bits.f64_bits)
    x2 = f64_from_bits(beta2_bits)
    b1 = x1.to(tl.float32)
    b2 = x2.to(tl.float32)
    eps32 = tl.full((), eps, tl.float32)
    wd = tl.full((), weight_decay, tl.float32)
    # t = step + 1; beta^t in fp64 by binary exponentiation (libdevice pow does not exist in the
    # interpreter): a few fp64 ulps from C's pow, far below the fp32 rounding that follows.
    # The betas enter the bias corrections as fp64 (torch's for-loop and the reference use the
    # Python floats).
    ti = (tl.load(step_ptr).to(tl.float64) + 1.0).to(tl.int64)
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
    step_size = (lr32.to(tl.float64) / (1.0 - pw1)).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.sqrt(1.0 - pw2)).to(tl.float32)
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
    if DECOUPLED:
        decay = lr32 * wd
        l2 = tl.full((), 0.0, tl.float32)
    else:
        decay = tl.full((), 0.0, tl.float32)
        l2 = wd
    return ti, lr32, b1, b2, eps32, step_size, inv_bc2_sqrt, gm, decay, l2


@triton.jit
def load_weight(p_ptr, master_ptr, offs, mask, DT: tl.constexpr, MODE: tl.constexpr):
    """adam_math.h::load_weight: the fp32 value of the param per master mode."""
    if MODE == 1:
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    elif MODE == 2:
        # remainder_join: hi16 = p_bits - (rem < 0), lo16 = rem
        pb = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        rem = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.where(rem < 0, (pb - 1) & 0xFFFF, pb)
        w = ((hi << 16) | (rem & 0xFFFF)).to(tl.float32, bitcast=True)
    else:
        w = load_f32(p_ptr, offs, mask, DT)
    return w


@triton.jit
def store_weight(w, p_ptr, master_ptr, offs, mask, seed, ti, slot, DT: tl.constexpr,
                 MODE: tl.constexpr):
    """adam_math.h::store_weight: the param (and its master) from the updated fp32 value; `offs`
    is the logical element index, `slot` the tensor's position in the call (SR stream)."""
    if MODE == 1:
        tl.store(master_ptr + offs, w, mask=mask)
        store_f32(p_ptr, offs, w, mask, DT)
    elif MODE == 2:
        # remainder_split: lo16 -> remainder, hi16 rounded to nearest (ties away from zero);
        # NaN -> the canonical 0x7FC00000 (GPU arithmetic makes 0x7FFFFFFF, which would round
        # to a -0.0 param)
        u = w.to(tl.uint32, bitcast=True)
        u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, u)
        lo = u & 0xFFFF
        phi = ((u >> 16) + (lo >> 15)) & 0xFFFF
        tl.store(p_ptr + offs, phi.to(tl.int32).to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, lo.to(tl.int32).to(tl.int16), mask=mask)
    elif MODE == 3:
        # bf16_bits_stochastic(w, random16(step_seed(seed, t), slot, index))
        sseed = seed.to(tl.uint64) ^ (ti.to(tl.uint64) * 0xD1B54A32D192ED03)
        # random16(sseed, slot, index): splitmix64 finalizer, uint64 wrap-around
        z = (sseed + 0x9E3779B97F4A7C15 * (slot.to(tl.uint64) + 1)
             + offs.to(tl.uint64) * 0xBF58476D1CE4E5B9)
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        r16 = (z >> 48).to(tl.uint32)
        u = w.to(tl.uint32, bitcast=True)
        bits = (u + r16) >> 16
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, bits)
        tl.store(p_ptr + offs, bits.to(tl.int32).to(tl.int16), mask=mask)
    else:
        store_f32(p_ptr, offs, w, mask, DT)
