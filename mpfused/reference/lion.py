"""Reference Lion step (float64 math, results stored in each tensor's dtype): the update of
csrc/include/mpfused/lion_math.h (sign(0) = 0, NaN stays NaN) with the master modes of the Adam
reference."""
from __future__ import annotations

import torch

from mpfused.reference.adam import param_updates, write_master


def lion_update(w, g, m, lr, beta1, beta2):
    """One Lion update in float64 (lion_math.h::lion_element after the decay), shared with the
    8-bit reference: (new w, new m)."""
    c = beta1 * m + (1 - beta1) * g
    sign = torch.where(torch.isnan(c), c, torch.sign(c))  # 0 -> 0; NaN stays NaN (torch.sign: 0)
    return w - lr * sign, beta2 * m + (1 - beta2) * g


def lion_step_(params, grads, exp_avgs, masters, steps, *, lr, lr_tensor, beta1, beta2, weight_decay,
               maximize, master_mode, grad_scale=None, found_inf=None, norm_sq=None,
               max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    # param_updates: unscale, clip, maximize, and w *= 1 - lr * wd (decoupled=True)
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, True,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        w, m = lion_update(w, g, exp_avgs[i].double(), lr, beta1, beta2)
        exp_avgs[i].copy_(m)
        write_master(p, master, mode, w.float(), seed, t, stream)
