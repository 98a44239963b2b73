"""Triton SGD step with a block-wise 8-bit momentum buffer (the op mpfused::sgd8bit_step_), and
with BITS = 4 the 4-bit one (mpfused::sgd4bit_step_: codes packed two per byte into the signed
16-entry map, no sign rule).

One program per quantization block, one launch per non-empty tensor (host side:
_quant8.one_state_step). Per block: the buffer is dequantized with the block's old absmax, updated
by the 32-bit kernel's math (sgd.py: sgd_scalars, then sgd_element in fp32, no FMA contraction),
and requantized: new absmax = max |buffer| of the block (NaN gives a NaN absmax), nearest code of
the signed map with bitsandbytes' sign rule (_quant8.store_quantized, as the Adam 8-bit kernel's
first moment). A tensor whose step counter is 0 takes its first step: its buffer becomes the
gradient itself (the old codes are not used), as the 32-bit op.

Nothing is read on the host (step counters, found_inf, grad_scale, norm_sq, a tensor lr), and a
skipped step (found_inf > 0) touches nothing, step counters included.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.operand_checks import check_quantized_momentum
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import load_block, step_skipped
from mpfused.triton_kernels._quant8 import dequantize, one_state_step, store_quantized
from mpfused.triton_kernels.sgd import sgd_element, sgd_scalars


@triton.jit(do_not_specialize=["lr_bits", "momentum_bits", "dampening_bits", "wd_bits",
                               "mgn_bits", "zero_code", "seed", "stream"])
def _sgd8bit_kernel(p_ptr, g_ptr, c_ptr, a_ptr, w_ptr, map_ptr, thr_ptr, step_ptr, lr_ptr,
                    scale_ptr, found_ptr, norm_ptr, n, lr_bits, momentum_bits, dampening_bits,
                    wd_bits, mgn_bits, zero_code, seed, stream, DT: tl.constexpr,
                    MODE: tl.constexpr, HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr,
                    HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr, NESTEROV: tl.constexpr,
                    MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr = 8):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return

    # ---- per-tensor scalars ---------------------------------------------------------------------
    t, lr, wd, momentum, one_m_damp, gm = sgd_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, momentum_bits, dampening_bits, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE)
    first = t <= 1.0

    # ---- the block: dequantize, update in fp32, store the param, requantize --------------------
    offs, mask, w, g = load_block(p_ptr, g_ptr, w_ptr, n, DT, MODE, BLOCK)
    g = g * gm
    buf = dequantize(c_ptr, map_ptr, a_ptr, offs, mask, BITS)
    w, buf = sgd_element(w, g, buf, lr, wd, momentum, one_m_damp, first, True, NESTEROV)
    store_weight(w, p_ptr, w_ptr, offs, mask, seed, t.to(tl.int64), stream, DT, MODE)
    store_quantized(buf, c_ptr, a_ptr, thr_ptr, offs, mask, zero_code, BITS == 8, BITS)


@on_tensors_device
def sgd8bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, *, block_size, lr,
                  lr_tensor, momentum, dampening, weight_decay, nesterov, maximize, master_mode,
                  grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0,
                  param_ids=(), elem_offsets=(), _bits=8):
    op = "sgd8bit_step_" if _bits == 8 else "sgd4bit_step_"
    check_quantized_momentum(op, momentum)
    one_state_step(_sgd8bit_kernel, op, "momentum_buffers", params, grads,
                   momentum_buffers, absmaxs, masters, steps, qmap, block_size, master_mode,
                   (lr, momentum, dampening, weight_decay), lr_tensor, grad_scale, found_inf,
                   norm_sq, max_grad_norm, seed, param_ids, elem_offsets,
                   bits=_bits, NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize))


def sgd4bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, **kwargs):
    """mpfused::sgd4bit_step_: the 8-bit kernel specialized on 4-bit codes (BITS=4)."""
    return sgd8bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, **kwargs,
                         _bits=4)
