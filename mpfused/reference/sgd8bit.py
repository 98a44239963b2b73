"""Reference SGD step with a block-wise 8-bit momentum buffer (bitsandbytes' SGD8bit layout), and
with ``_bits=4`` the 4-bit one (sgd4bit_step_): dequantize (float32 products), torch.optim.SGD's
momentum update in float64, round the new buffer to float32, take its block absmax and requantize
it (the codec of the width: reference/adam8bit.py; the signed map's sign rule for 8-bit codes).
The kernels update in float32, so a code may differ where the buffer lies within rounding of a
threshold."""
from __future__ import annotations

from mpfused.operand_checks import check_quantized_momentum
from mpfused.reference.adam import param_updates, write_master
from mpfused.reference.adam8bit import check_sizes, dequantized, store_quantized
from mpfused.reference.sgd import momentum_update


def sgd8bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, *, block_size, lr,
                  lr_tensor, momentum, dampening, weight_decay, nesterov, maximize, master_mode,
                  grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0,
                  param_ids=(), elem_offsets=(), _bits=8):
    op = f"sgd{_bits}bit_step_"
    check_quantized_momentum(op, momentum)
    check_sizes(op, params, (("momentum_buffers", momentum_buffers),),
                (("qmap (signed map)", qmap),), _bits)
    # param_updates: unscale, clip, maximize, and L2 decay into g (decoupled=False), as torch
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, False,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        buf = dequantized(momentum_buffers[i], absmaxs[i], qmap, block_size, p.shape, _bits)
        d, buf = momentum_update(g, buf, t, momentum, dampening, nesterov)
        store_quantized(momentum_buffers[i], absmaxs[i], buf, qmap, block_size, True, _bits)
        write_master(p, master, mode, (w - lr * d).float(), seed, t, stream)
