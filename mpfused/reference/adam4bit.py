"""Reference Adam/AdamW step with block-wise 4-bit moments: adam8bit's reference with the 4-bit
codec (mpfused/quant4.py): dequantize (float32 products), update in float64, round the new
moments to float32, take their block absmax and requantize them (nearest code, no sign rule)."""
from __future__ import annotations

import torch

from mpfused.ops.checks import check_codes, check_qmap
from mpfused.quant4 import dequantize4_blockwise, quantize4_blockwise
from mpfused.reference.adam import param_updates, write_master


def _check(params, exp_avgs, exp_avg_sqs, qmap1, qmap2):
    """The 4-bit size rules a kernel indexes by (the ops' rules, mpfused/ops/checks.py)."""
    dev = params[0].device if params else qmap1.device
    for name, m in (("qmap1", qmap1), ("qmap2", qmap2)):
        check_qmap("adam4bit_step_", name, m, dev, 4, values=True)
    for name, lst in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        check_codes("adam4bit_step_", name, lst, params, dev, 4, values=True)


def adam4bit_step_(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                   qmap1, qmap2, *, block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                   maximize, decoupled, master_mode, grad_scale=None, found_inf=None,
                   norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    _check(params, exp_avgs, exp_avg_sqs, qmap1, qmap2)
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        shape = p.shape
        m = dequantize4_blockwise(exp_avgs[i], absmax1s[i], qmap1, block_size, shape).double()
        v = dequantize4_blockwise(exp_avg_sqs[i], absmax2s[i], qmap2, block_size, shape).double()
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        bc1 = 1 - torch.tensor(beta1, dtype=torch.float64) ** t
        bc2 = 1 - torch.tensor(beta2, dtype=torch.float64) ** t
        denom = v.sqrt() / bc2.sqrt() + eps
        w = w - (lr / bc1) * m / denom
        for codes, absmax, s, qmap in ((exp_avgs[i], absmax1s[i], m, qmap1),
                                       (exp_avg_sqs[i], absmax2s[i], v, qmap2)):
            c, a = quantize4_blockwise(s.float(), qmap, block_size)
            codes.copy_(c.reshape(codes.shape))
            absmax.copy_(a)
        write_master(p, master, mode, w.float(), seed, t, stream)
