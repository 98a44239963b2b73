"""Reference Adam/AdamW step with block-wise 8-bit moments: dequantize (float32 products), update in
float64, round the new moments to float32, take their block absmax and requantize them
(mpfused/quant_maps.py codec). The kernels do the update in float32, so a code may differ where a
moment lies within rounding of a decision threshold."""
from __future__ import annotations

import torch

from mpfused.quant_maps import dequantize_blockwise, quantize_blockwise
from mpfused.reference.adam import param_updates, write_master


def dequantized(codes, absmax, qmap, block_size):
    """The state a kernel reads, as float64: qmap[code] * absmax (one float32 product)."""
    return dequantize_blockwise(codes, absmax, qmap, block_size).double()


def store_quantized(codes, absmax, state, qmap, block_size, keep_negative):
    """Round the updated state to float32, as the kernels hold it, then write its block absmax
    and its codes (``keep_negative``: bitsandbytes' sign rule, for a signed state)."""
    c, a = quantize_blockwise(state.float(), qmap, block_size, keep_negative=keep_negative)
    codes.copy_(c)
    absmax.copy_(a)


def adam8bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, *, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = dequantized(exp_avgs[i], absmax1s[i], qmap1, block_size)
        v = dequantized(exp_avg_sqs[i], absmax2s[i], qmap2, block_size)
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        # float64 tensors: beta = 1 gives inf/NaN, not a Python ZeroDivisionError
        bc1 = 1 - torch.tensor(beta1, dtype=torch.float64) ** t
        bc2 = 1 - torch.tensor(beta2, dtype=torch.float64) ** t
        denom = v.sqrt() / bc2.sqrt() + eps
        w = w - (lr / bc1) * m / denom
        store_quantized(exp_avgs[i], absmax1s[i], m, qmap1, block_size, keep_negative=True)
        store_quantized(exp_avg_sqs[i], absmax2s[i], v, qmap2, block_size, keep_negative=False)
        write_master(p, master, mode, w.float(), seed, t, stream)
