"""Reference Lion step with a block-wise 4-bit moment (torchao's 4-bit format of AdamW4bit's
first moment, mpfused/quant4.py): lion8bit's reference with the 4-bit codec: dequantize (float32
products), the Lion update in float64 (sign(0) = 0, NaN stays NaN), round the new moment to
float32, take its block absmax and requantize it (nearest code of the signed 16-entry map, no
sign rule). The kernels update in float32, so a code may differ where the moment lies within
rounding of a threshold."""
from __future__ import annotations

from mpfused.reference.adam import param_updates, write_master
from mpfused.reference.lion import lion_update
from mpfused.reference.sgd4bit import check_one_state4, dequantized4, store_quantized4


def lion4bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, block_size, lr,
                   lr_tensor, beta1, beta2, weight_decay, maximize, master_mode, grad_scale=None,
                   found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(),
                   elem_offsets=()):
    check_one_state4("lion4bit_step_", "exp_avgs", params, exp_avgs, qmap)
    # param_updates: unscale, clip, maximize, and w *= 1 - lr * wd (decoupled=True)
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, True,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = dequantized4(exp_avgs[i], absmaxs[i], qmap, block_size, p.shape)
        w, m = lion_update(w, g, m, lr, beta1, beta2)
        store_quantized4(exp_avgs[i], absmaxs[i], m, qmap, block_size)
        write_master(p, master, mode, w.float(), seed, t, stream)
