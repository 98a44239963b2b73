"""Triton Lion step with a block-wise 8-bit moment (the op mpfused::lion8bit_step_), and with
BITS = 4 the 4-bit one (mpfused::lion4bit_step_: codes packed two per byte into the signed
16-entry map, no sign rule).

One program per quantization block, one launch per non-empty tensor (host side:
_quant8.one_state_step). Per block: the moment is dequantized with the block's old absmax,
updated by the 32-bit kernel's math (lion.py: lion_scalars, then lion_element in fp32, no FMA
contraction; sign(0) = 0, NaN stays NaN), and requantized: new absmax = max |moment| of the block
(NaN gives a NaN absmax), nearest code of the signed map with bitsandbytes' sign rule
(_quant8.store_quantized, as the Adam 8-bit kernel's first moment).

Nothing is read on the host (step counters, found_inf, grad_scale, norm_sq, a tensor lr), and a
skipped step (found_inf > 0) touches nothing, step counters included.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.triton_kernels._device import on_tensors_device
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import load_block, step_skipped
from mpfused.triton_kernels._quant8 import dequantize, one_state_step, store_quantized
from mpfused.triton_kernels._step_scalars import step_number
from mpfused.triton_kernels.lion import lion_element, lion_scalars


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "zero_code", "seed", "stream"])
def _lion8bit_kernel(p_ptr, g_ptr, c_ptr, a_ptr, w_ptr, map_ptr, thr_ptr, step_ptr, lr_ptr,
                     scale_ptr, found_ptr, norm_ptr, n, lr_bits, beta1_bits, beta2_bits, wd_bits,
                     mgn_bits, zero_code, seed, stream, DT: tl.constexpr, MODE: tl.constexpr,
                     HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr,
                     HAS_NORM: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
                     BITS: tl.constexpr = 8):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return

    # ---- per-tensor scalars ---------------------------------------------------------------------
    lr, decay_mult, b1, one_m_b1, b2, one_m_b2, gm = lion_scalars(
        lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, wd_bits, mgn_bits, HAS_LR,
        HAS_SCALE, HAS_NORM, MAXIMIZE)

    # ---- the block: dequantize, update in fp32, store the param, requantize --------------------
    offs, mask, w, g = load_block(p_ptr, g_ptr, w_ptr, n, DT, MODE, BLOCK)
    g = g * gm
    m = dequantize(c_ptr, map_ptr, a_ptr, offs, mask, BITS)
    w, m = lion_element(w, g, m, lr, decay_mult, b1, one_m_b1, b2, one_m_b2)
    ti = step_number(step_ptr).to(tl.int64)  # the stochastic-rounding draw of step t
    store_weight(w, p_ptr, w_ptr, offs, mask, seed, ti, stream, DT, MODE)
    store_quantized(m, c_ptr, a_ptr, thr_ptr, offs, mask, zero_code, BITS == 8, BITS)


@on_tensors_device
def lion8bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, *, block_size, lr,
                   lr_tensor, beta1, beta2, weight_decay, maximize, master_mode, grad_scale=None,
                   found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(),
                   elem_offsets=(), _bits=8):
    op = "lion8bit_step_" if _bits == 8 else "lion4bit_step_"
    one_state_step(_lion8bit_kernel, op, "exp_avgs", params, grads, exp_avgs,
                   absmaxs, masters, steps, qmap, block_size, master_mode,
                   (lr, beta1, beta2, weight_decay), lr_tensor, grad_scale, found_inf, norm_sq,
                   max_grad_norm, seed, param_ids, elem_offsets, bits=_bits,
                   MAXIMIZE=bool(maximize))


def lion4bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, **kwargs):
    """mpfused::lion4bit_step_: the 8-bit kernel specialized on 4-bit codes (BITS=4)."""
    return lion8bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, **kwargs,
                          _bits=4)
