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

from mpfused.operand_checks import adam8bit_operands
from mpfused.quant_maps import thresholds, zero_code
from mpfused.triton_kernels._adam_scalars import adam_scalars
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import block_offsets, load_param, step_skipped
from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, i64_bits,
                                          num_warps_for)
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.triton_kernels._elementwise import advance_steps
from mpfused.triton_kernels._quant8 import dequantize, for_each_quantized, store_quantized

_M64 = (1 << 64) - 1


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "zero_code", "seed", "stream"])
def _adam8bit_kernel(p_ptr, g_ptr, c1_ptr, c2_ptr, w_ptr, a1_ptr, a2_ptr, map1_ptr, map2_ptr,
                     thr1_ptr, thr2_ptr, step_ptr, lr_ptr, scale_ptr, found_ptr, norm_ptr,
                     n, lr_bits, beta1_bits, beta2_bits, eps, wd_bits, mgn_bits, zero_code,
                     seed, stream, DT: tl.constexpr, MODE: tl.constexpr,
                     DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_LR: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr,
                     BLOCK: tl.constexpr, BITS: tl.constexpr = 8):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return
    offs, mask = block_offsets(n, BLOCK)
    # ---- per-tensor scalars (adam_math.h::adam_scalars), shared with triton_kernels/adam.py ----
    ti, b2, eps32, one_m_b1, one_m_b2, step_size, inv_bc2_sqrt, gm, decay, l2 = adam_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, eps, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE, DECOUPLED)
    # ---- fp32 value of the param, the grad ----
    w, g = load_param(p_ptr, g_ptr, w_ptr, offs, mask, DT, MODE)
    # ---- dequantize with the old absmax, update in fp32 (adam_element) ----
    m = dequantize(c1_ptr, map1_ptr, a1_ptr, offs, mask, BITS)
    v = dequantize(c2_ptr, map2_ptr, a2_ptr, offs, mask, BITS)
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
    # ---- new absmax of the updated moments, requantize (the sign rule for 8-bit m only) ----
    store_quantized(m, c1_ptr, a1_ptr, thr1_ptr, offs, mask, zero_code, BITS == 8, BITS)
    store_quantized(v, c2_ptr, a2_ptr, thr2_ptr, offs, mask, zero_code, False, BITS)


@on_tensors_device
def adam8bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, *, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=(),
                   _bits=8):
    if not params:
        return
    adam8bit_operands(f"adam{_bits}bit_step_", params, grads, exp_avgs, exp_avg_sqs, absmax1s,
                      absmax2s, masters, steps, qmap1, qmap2, block_size=block_size, bits=_bits,
                      master_mode=master_mode, lr_tensor=lr_tensor, grad_scale=grad_scale,
                      found_inf=found_inf, norm_sq=norm_sq, param_ids=param_ids,
                      elem_offsets=elem_offsets, values=True)
    streams = sr_streams(len(params), param_ids, elem_offsets)
    dev = params[0].device
    thr1, thr2 = thresholds(qmap1), thresholds(qmap2)
    zc = zero_code(qmap1)
    has_norm = norm_sq is not None and max_grad_norm > 0
    b1_bits, b2_bits, mgn_bits = f64_bits(beta1), f64_bits(beta2), f64_bits(max_grad_norm)
    lr_bits, wd_bits = f64_bits(lr), f64_bits(weight_decay)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)

    def launch(i, mode, pk, gk, wk):
        grid = (triton.cdiv(pk.numel(), block_size),)
        _adam8bit_kernel[grid](
            as_kernel_arg(pk), as_kernel_arg(gk), exp_avgs[i], exp_avg_sqs[i],
            wk if wk is not None else dummy, absmax1s[i], absmax2s[i], qmap1, qmap2, thr1, thr2,
            steps[i], lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            norm_sq if has_norm else dummy,
            pk.numel(), lr_bits, b1_bits, b2_bits, float(eps), wd_bits, mgn_bits,
            zc, int(seed) & _M64, i64_bits(streams[i]),
            DT=DTYPE_CODE[pk.dtype], MODE=mode, DECOUPLED=bool(decoupled), MAXIMIZE=bool(maximize),
            HAS_LR=lr_tensor is not None, HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None, HAS_NORM=has_norm, BLOCK=block_size, BITS=_bits,
            num_warps=num_warps_for(block_size),
            enable_fp_fusion=False)  # no FMA contraction: rounds as the CPU kernel

    for_each_quantized(params, grads, masters, master_mode, launch)
    advance_steps(steps, found_inf)  # on device, by a taken step only


def adam4bit_step_(*args, **kwargs):
    """mpfused::adam4bit_step_: the 8-bit kernel specialized on 4-bit codes (BITS=4)."""
    return adam8bit_step_(*args, **kwargs, _bits=4)
