"""Reference SGD step (float64 math, results stored in each tensor's dtype): torch.optim.SGD's
update (csrc/include/mpfused/sgd_math.h) with the master modes of the Adam reference."""
from __future__ import annotations

from mpfused.reference.adam import param_updates, write_master


def momentum_update(g, buf, t, momentum, dampening, nesterov):
    """torch.optim.SGD's momentum in float64 (sgd_math.h::sgd_element), shared with the 8-bit
    reference: (the direction the param moves against, the new buffer). On the first step (t = 1)
    the buffer becomes g itself and the old one (``buf``, any dtype) is not read."""
    buf = g if t <= 1 else momentum * buf.double() + (1 - dampening) * g
    return (g + momentum * buf if nesterov else buf), buf


def sgd_step_(params, grads, momentum_buffers, masters, steps, *, lr, lr_tensor, momentum, dampening,
              weight_decay, nesterov, maximize, master_mode, grad_scale=None, found_inf=None,
              norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    if momentum != 0 and len(momentum_buffers) != len(params):
        raise RuntimeError("mpfused: sgd_step_: momentum != 0 needs one momentum buffer per param")
    # param_updates: unscale, clip, maximize, and L2 decay into g (decoupled=False), as torch
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, False,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        if momentum != 0:
            g, buf = momentum_update(g, momentum_buffers[i], t, momentum, dampening, nesterov)
            momentum_buffers[i].copy_(buf)
        w = w - lr * g
        write_master(p, master, mode, w.float(), seed, t, stream)
