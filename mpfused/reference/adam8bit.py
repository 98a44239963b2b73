"""Reference Adam/AdamW step with block-wise 8-bit moments: dequantize (float32 products), update in
float64, round the new moments to float32, take their block absmax and requantize them
(mpfused/quant_maps.py codec). The kernels do the update in float32, so a code may differ where a
moment lies within rounding of a decision threshold."""
from __future__ import annotations

import torch

from mpfused.quant_maps import dequantize_blockwise, quantize_blockwise
from mpfused.reference.adam import param_updates, write_master


def adam8bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = dequantize_blockwise(exp_avgs[i], absmax1s[i], qmap1, block_size).double()
        v = dequantize_blockwise(exp_avg_sqs[i], absmax2s[i], qmap2, block_size).double()
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        # float64 tensors: beta = 1 gives inf/NaN, not a Python ZeroDivisionError
        bc1 = 1 - torch.tensor(beta1, dtype=torch.float64) ** t
        bc2 = 1 - torch.tensor(beta2, dtype=torch.float64) ** t
        denom = v.sqrt() / bc2.sqrt() + eps
        w = w - (lr / bc1) * m / denom
        c1, a1 = quantize_blockwise(m.float(), qmap1, block_size, keep_negative=True)
        c2, a2 = quantize_blockwise(v.float(), qmap2, block_size, keep_negative=False)
        exp_avgs[i].copy_(c1)
        exp_avg_sqs[i].copy_(c2)
        absmax1s[i].copy_(a1)
        absmax2s[i].copy_(a2)
        write_master(p, master, mode, w.float(), seed, t, stream)
