"""Reference SGD step with a block-wise 4-bit momentum buffer (torchao's 4-bit format of
AdamW4bit's first moment, mpfused/quant4.py): sgd8bit's reference with the 4-bit codec:
dequantize (float32 products), torch.optim.SGD's momentum update in float64, round the new buffer
to float32, take its block absmax and requantize it (nearest code of the signed 16-entry map, no
sign rule). The kernels update in float32, so a code may differ where the buffer lies within
rounding of a threshold. ``dequantized4`` / ``store_quantized4`` / ``check_one_state4`` are
shared with lion4bit's reference."""
from __future__ import annotations

from mpfused.ops.checks import check_codes, check_qmap, check_quantized_momentum
from mpfused.quant4 import dequantize4_blockwise, quantize4_blockwise
from mpfused.reference.adam import param_updates, write_master
from mpfused.reference.sgd import momentum_update


def check_one_state4(op, state_name, params, codes, qmap):
    """The 4-bit size rules a kernel indexes by (the ops' rules, mpfused/ops/checks.py): a
    16-entry map, ceil(numel / 2) code bytes."""
    dev = params[0].device if params else qmap.device
    check_qmap(op, "qmap", qmap, dev, 4, values=True)
    check_codes(op, state_name, codes, params, dev, 4, values=True)


def dequantized4(codes, absmax, qmap, block_size, shape):
    """The state a kernel reads, as float64: qmap[code] * absmax (one float32 product)."""
    return dequantize4_blockwise(codes, absmax, qmap, block_size, shape).double()


def store_quantized4(codes, absmax, state, qmap, block_size):
    """Round the updated state to float32, as the kernels hold it, then write its block absmax
    and its packed codes (nearest code, no sign rule)."""
    c, a = quantize4_blockwise(state.float(), qmap, block_size)
    codes.copy_(c.reshape(codes.shape))
    absmax.copy_(a)


def sgd4bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, *, block_size, lr,
                  lr_tensor, momentum, dampening, weight_decay, nesterov, maximize, master_mode,
                  grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0,
                  param_ids=(), elem_offsets=()):
    check_quantized_momentum("sgd4bit_step_", momentum)
    check_one_state4("sgd4bit_step_", "momentum_buffers", params, momentum_buffers, qmap)
    # param_updates: unscale, clip, maximize, and L2 decay into g (decoupled=False), as torch
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, False,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        buf = dequantized4(momentum_buffers[i], absmaxs[i], qmap, block_size, p.shape)
        d, buf = momentum_update(g, buf, t, momentum, dampening, nesterov)
        store_quantized4(momentum_buffers[i], absmaxs[i], buf, qmap, block_size)
        write_master(p, master, mode, (w - lr * d).float(), seed, t, stream)
