"""Reference Adam/AdamW step with block-wise 8-bit moments, and with ``_bits=4`` the 4-bit one
(adam4bit_step_): dequantize (float32 products), update in float64, round the new moments to
float32, take their block absmax and requantize them. The kernels do the update in float32, so a
code may differ where a moment lies within rounding of a decision threshold.

The codec, one per code width, shared by every block-wise reference (SGD, Lion, Adam):
``bits=8`` is mpfused/quant_maps.py (256-entry maps, one code per element, bitsandbytes' sign
rule for a signed state), ``bits=4`` mpfused/quant4.py (16-entry maps, two codes per byte,
nearest code, no sign rule)."""
from __future__ import annotations

import torch

from mpfused.operand_checks import check_codes, check_qmap, check_signed_map
from mpfused.quant4 import dequantize4_blockwise, quantize4_blockwise
from mpfused.quant_maps import dequantize_blockwise, quantize_blockwise
from mpfused.reference.adam import param_updates, write_master


def check_sizes(op, params, codes, qmaps, bits):
    """The run-time rules the kernels state too (the ops' rules, mpfused/operand_checks.py):
    code sizes, the maps' length and order, and an 8-bit signed map's +0.0 (the first map: Adam's
    qmap1, SGD's / Lion's qmap), so the reference refuses what every kernel refuses, before it
    writes. ``codes``, ``qmaps``: (name, value) pairs."""
    dev = params[0].device if params else qmaps[0][1].device
    for name, qmap in qmaps:
        check_qmap(op, name, qmap, dev, bits, values=True)
    if bits == 8 and params:
        check_signed_map(op, *qmaps[0])
    for name, lst in codes:
        check_codes(op, name, lst, params, dev, bits, values=True)


def dequantized(codes, absmax, qmap, block_size, shape, bits=8):
    """The state a kernel reads, as float64 of ``shape``: qmap[code] * absmax (one float32
    product)."""
    if bits == 4:
        return dequantize4_blockwise(codes, absmax, qmap, block_size, shape).double()
    return dequantize_blockwise(codes, absmax, qmap, block_size).double()


def store_quantized(codes, absmax, state, qmap, block_size, keep_negative, bits=8):
    """Round the updated state to float32, as the kernels hold it, then write its block absmax
    and its codes (``keep_negative``: bitsandbytes' sign rule for a signed 8-bit state; 4-bit
    codes take the nearest code, no sign rule)."""
    if bits == 4:
        c, a = quantize4_blockwise(state.float(), qmap, block_size)
        codes.copy_(c.reshape(codes.shape))
    else:
        c, a = quantize_blockwise(state.float(), qmap, block_size, keep_negative=keep_negative)
        codes.copy_(c)
    absmax.copy_(a)


def adam8bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, *, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=(),
                   _bits=8):
    check_sizes(f"adam{_bits}bit_step_", params,
                (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)),
                (("qmap1 (signed map)", qmap1), ("qmap2 (unsigned map)", qmap2)), _bits)
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = dequantized(exp_avgs[i], absmax1s[i], qmap1, block_size, p.shape, _bits)
        v = dequantized(exp_avg_sqs[i], absmax2s[i], qmap2, block_size, p.shape, _bits)
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        # float64 tensors: beta = 1 gives inf/NaN, not a Python ZeroDivisionError
        bc1 = 1 - torch.tensor(beta1, dtype=torch.float64) ** t
        bc2 = 1 - torch.tensor(beta2, dtype=torch.float64) ** t
        denom = v.sqrt() / bc2.sqrt() + eps
        w = w - (lr / bc1) * m / denom
        store_quantized(exp_avgs[i], absmax1s[i], m, qmap1, block_size, True, _bits)
        store_quantized(exp_avg_sqs[i], absmax2s[i], v, qmap2, block_size, False, _bits)
        write_master(p, master, mode, w.float(), seed, t, stream)
