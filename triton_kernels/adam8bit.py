"""Triton Adam/AdamW step with block-wise 8-bit moments (the op mpfused::adam8bit_step_).

One program per quantization block, one launch per tensor (no pointer tables: they are not
portable to the interpreter). The per-element math is csrc/include/mpfused/adam_math.h +
quant8_math.h transcribed: IEEE division and square root (div_rn/sqrt_rn, not Triton's
approximate defaults), the binary search over the decision thresholds, bitsandbytes' sign rule.
Everything a step depends on is read on device (step counter, lr tensor, grad_scale, found_inf,
norm_sq): no host sync. Per-tensor scalars are formed as in triton_kernels/adam.py (constants
derived in fp64 and rounded once, beta^t by binary exponentiation: a few fp64 ulps from C's pow, below the fp32 rounding that
follows); no FMA contraction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpfused.quant_maps import thresholds, zero_code
from mpfused.triton_kernels._adam_scalars import adam_scalars
from mpfused.triton_kernels._master import load_weight, store_weight
from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, i64_bits, load_f32,
                                          num_warps_for)
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.triton_kernels._elementwise import advance_steps, kernel_mode

MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC = 0, 1, 2, 3
_M64 = (1 << 64) - 1


@triton.jit
def _encode(thr_ptr, x):
    # quant8_encode: code = #{i : x > thr[i]} by an 8-step binary search.
    c = tl.where(x > tl.load(thr_ptr + 127), 128, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 63), 64, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 31), 32, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 15), 16, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 7), 8, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 3), 4, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 1), 2, 0)
    c += tl.where(x > tl.load(thr_ptr + c), 1, 0)
    return c


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "zero_code", "seed", "stream"])
def _adam8bit_kernel(p_ptr, g_ptr, c1_ptr, c2_ptr, w_ptr, a1_ptr, a2_ptr, map1_ptr, map2_ptr,
                     thr1_ptr, thr2_ptr, step_ptr, lr_ptr, scale_ptr, found_ptr, norm_ptr,
                     n, lr_bits, beta1_bits, beta2_bits, eps, wd_bits, mgn_bits, zero_code,
                     seed, stream, DT: tl.constexpr, MODE: tl.constexpr,
                     DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_LR: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr,
                     BLOCK: tl.constexpr):
    if HAS_FOUND:
        if tl.load(found_ptr) > 0.0:  # skipped step: nothing is touched
            return
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit indexing
    mask = offs < n
    # ---- per-tensor scalars (adam_math.h::adam_scalars), shared with triton_kernels/adam.py ----
    ti, b2, eps32, one_m_b1, one_m_b2, step_size, inv_bc2_sqrt, gm, decay, l2 = adam_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, eps, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE, DECOUPLED)
    # ---- fp32 value of the param ----
    w = load_weight(p_ptr, w_ptr, offs, mask, DT, MODE)
    g = load_f32(g_ptr, offs, mask, DT)
    # ---- dequantize with the old absmax, update in fp32 (adam_element) ----
    c1 = tl.load(c1_ptr + offs, mask=mask, other=0).to(tl.int32)
    c2 = tl.load(c2_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(map1_ptr + c1) * tl.load(a1_ptr + pid)
    v = tl.load(map2_ptr + c2) * tl.load(a2_ptr + pid)
    g = g * gm
    if not DECOUPLED:  # Adam's L2 term (when nonzero); AdamW leaves g as it is, like torch
        g = tl.where(l2 != 0.0, g + l2 * w, g)
    w = w - decay * w
    m = m + one_m_b1 * (g - m)
    v = b2 * v + one_m_b2 * (g * g)
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps32
    w = w - tl.div_rn(step_size * m, denom)
    # ---- store the param ----
    store_weight(w, p_ptr, w_ptr, offs, mask, seed, ti, stream, DT, MODE)
    # ---- new absmax of the updated moments, requantize ----
    # max over the bit patterns of |x| (as the CPU and CUDA kernels): ordered as the floats, and a
    # NaN moment (above inf) gives a NaN absmax; tl.max on floats would skip the NaN
    am1 = tl.max(tl.where(mask, tl.abs(m), 0.0).to(tl.uint32, bitcast=True), axis=0)
    am2 = tl.max(tl.where(mask, tl.abs(v), 0.0).to(tl.uint32, bitcast=True), axis=0)
    am1 = am1.to(tl.float32, bitcast=True)
    am2 = am2.to(tl.float32, bitcast=True)
    tl.store(a1_ptr + pid, am1)
    tl.store(a2_ptr + pid, am2)
    one = tl.full((), 1.0, tl.float32)
    r1 = tl.div_rn(one, am1)  # quant8_inv_scale: saturates at FLT_MAX
    r1 = tl.where(r1 < 3.4028234663852886e38, r1, 3.4028234663852886e38)
    r2 = tl.div_rn(one, am2)
    r2 = tl.where(r2 < 3.4028234663852886e38, r2, 3.4028234663852886e38)
    q1 = _encode(thr1_ptr, m * r1)
    q2 = _encode(thr2_ptr, v * r2)
    neg = (m.to(tl.uint32, bitcast=True) >> 31) != 0
    q1 = tl.where(neg & (q1 == zero_code), q1 - 1, q1)
    tl.store(c1_ptr + offs, q1.to(tl.uint8), mask=mask)
    tl.store(c2_ptr + offs, q2.to(tl.uint8), mask=mask)


@on_tensors_device
def adam8bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    if not params:
        return
    streams = sr_streams(len(params), param_ids, elem_offsets)
    if block_size not in (64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"mpfused: block_size must be a power of two in [64, 4096], got {block_size}")
    dev = params[0].device
    lists = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                 absmax1s=absmax1s, absmax2s=absmax2s, masters=masters, steps=steps)
    for name, t in [(f"{k}[{i}]", t) for k, ts in lists.items() for i, t in enumerate(ts)] + [
            ("qmap1", qmap1), ("qmap2", qmap2), ("lr_tensor", lr_tensor),
            ("grad_scale", grad_scale), ("found_inf", found_inf), ("norm_sq", norm_sq)]:
        if t is not None and t.device != dev:
            raise RuntimeError(f"mpfused: {name} is on {t.device}, params[0] on {dev}: one device "
                               "per call")
    thr1, thr2 = thresholds(qmap1), thresholds(qmap2)
    zc = zero_code(qmap1)
    has_norm = norm_sq is not None and max_grad_norm > 0
    b1_bits, b2_bits, mgn_bits = f64_bits(beta1), f64_bits(beta2), f64_bits(max_grad_norm)
    lr_bits, wd_bits = f64_bits(lr), f64_bits(weight_decay)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        mode = kernel_mode(p.dtype, int(master_mode))
        w = masters[i] if mode in (MASTER_FP32, MASTER_REMAINDER) else None
        # block layout = logical order: every operand contiguous (8-bit state always is)
        ops = [t if t is None or t.is_contiguous() else t.contiguous() for t in (p, grads[i], w)]
        pk, gk, wk = ops
        grid = (triton.cdiv(p.numel(), block_size),)
        _adam8bit_kernel[grid](
            as_kernel_arg(pk), as_kernel_arg(gk), exp_avgs[i], exp_avg_sqs[i],
            wk if wk is not None else dummy, absmax1s[i], absmax2s[i], qmap1, qmap2, thr1, thr2,
            steps[i], lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            norm_sq if has_norm else dummy,
            p.numel(), lr_bits, b1_bits, b2_bits, float(eps), wd_bits, mgn_bits,
            zc, int(seed) & _M64, i64_bits(streams[i]),
            DT=DTYPE_CODE[p.dtype], MODE=mode, DECOUPLED=bool(decoupled), MAXIMIZE=bool(maximize),
            HAS_LR=lr_tensor is not None, HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None, HAS_NORM=has_norm, BLOCK=block_size,
            num_warps=num_warps_for(block_size),
            enable_fp_fusion=False)  # no FMA contraction: rounds as the CPU kernel
        if pk is not p:
            p.copy_(pk)  # a skipped step wrote nothing: the copy-back restores the same
        if wk is not w:
            w.copy_(wk)
    advance_steps(steps, found_inf)  # on device, by a taken step only
