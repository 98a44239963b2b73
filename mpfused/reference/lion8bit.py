"""Reference Lion step with a block-wise 8-bit moment (bitsandbytes' Lion8bit layout), and with
``_bits=4`` the 4-bit one (lion4bit_step_): dequantize (float32 products), the Lion update in
float64 (sign(0) = 0, NaN stays NaN), round the new moment to float32, take its block absmax and
requantize it (the codec of the width: reference/adam8bit.py; the signed map's sign rule for
8-bit codes). The kernels update in float32, so a code may differ where the moment lies within
rounding of a threshold."""
from __future__ import annotations

from mpfused.reference.adam import param_updates, write_master
from mpfused.reference.adam8bit import check_sizes, dequantized, store_quantized
from mpfused.reference.lion import lion_update


def lion8bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, *, block_size, lr,
                   lr_tensor, beta1, beta2, weight_decay, maximize, master_mode, grad_scale=None,
                   found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(),
                   elem_offsets=(), _bits=8):
    check_sizes(f"lion{_bits}bit_step_", params, (("exp_avgs", exp_avgs),),
                (("qmap (signed map)", qmap),), _bits)
    # param_updates: unscale, clip, maximize, and w *= 1 - lr * wd (decoupled=True)
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, True,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = dequantized(exp_avgs[i], absmaxs[i], qmap, block_size, p.shape, _bits)
        w, m = lion_update(w, g, m, lr, beta1, beta2)
        store_quantized(exp_avgs[i], absmaxs[i], m, qmap, block_size, True, _bits)
        write_master(p, master, mode, w.float(), seed, t, stream)
