"""Triton multi-tensor Lion step (the op mpfused::lion_step_): the math of
csrc/include/mpfused/lion_math.h, one launch per non-empty tensor (host side: _elementwise.py).

Numerics, as the native kernels: per-tensor scalars formed once per program as lion_scalars does
(lr, beta1 and beta2 rounded to fp32 from their fp64 values; 1 - lr * weight_decay, 1 - beta1 and
1 - beta2 derived in fp64 and rounded once; fp64 arguments travel exactly, as bit patterns:
_bits.f64_bits; the grad multiplier and a tensor lr from _step_scalars), then lion_element in
fp32 with no FMA contraction (enable_fp_fusion=False: compiled and interpreted runs round alike).
The master modes, stochastic rounding included, are _master.load_weight / store_weight.

Nothing is read on the host (step counters, found_inf, grad_scale, norm_sq, a tensor lr), and a
skipped step (found_inf > 0) touches nothing, step counters included.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, f64_from_bits,
                                          i64_bits)
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.operand_checks import lion_operands
from mpfused.triton_kernels._elementwise import (BLOCK, M64, advance_steps, for_each_tensor,
                                                 launch_options, scalar_operands)
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import load_block, step_skipped
from mpfused.triton_kernels._step_scalars import grad_multiplier, read_lr, step_number


@triton.jit
def sign_f32(x):
    """lion_math.h::sign_f32, torch.sign: +1 / -1, a zero keeps itself, NaN stays NaN."""
    return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, x))


@triton.jit
def lion_element(w, g, m, lr, decay_mult, beta1, one_m_b1, beta2, one_m_b2):
    """lion_math.h::lion_element on a block (g already times the grad multiplier): (w, m)."""
    w = w * decay_mult
    c = beta1 * m + one_m_b1 * g
    w = w - lr * sign_f32(c)
    m = beta2 * m + one_m_b2 * g
    return w, m


@triton.jit
def lion_scalars(lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, wd_bits, mgn_bits,
                 HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
                 MAXIMIZE: tl.constexpr):
    """lion_math.h::lion_scalars, per tensor, all fp32: (lr, 1 - lr * weight_decay, beta1,
    1 - beta1, beta2, 1 - beta2, grad multiplier)."""
    lr64 = read_lr(lr_ptr, lr_bits, HAS_LR)
    b1 = f64_from_bits(beta1_bits)
    b2 = f64_from_bits(beta2_bits)
    decay_mult = (1.0 - lr64 * f64_from_bits(wd_bits)).to(tl.float32)
    gm = grad_multiplier(scale_ptr, norm_ptr, mgn_bits, HAS_SCALE, HAS_NORM, MAXIMIZE)
    return (lr64.to(tl.float32), decay_mult, b1.to(tl.float32), (1.0 - b1).to(tl.float32),
            b2.to(tl.float32), (1.0 - b2).to(tl.float32), gm)


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "seed", "stream"])
def _lion_kernel(p_ptr, g_ptr, m_ptr, master_ptr, step_ptr, lr_ptr, scale_ptr, found_ptr,
                 norm_ptr, n, lr_bits, beta1_bits, beta2_bits, wd_bits, mgn_bits, seed, stream,
                 DT: tl.constexpr, MODE: tl.constexpr, MAXIMIZE: tl.constexpr,
                 HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr,
                 HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return

    # ---- per-tensor scalars ---------------------------------------------------------------------
    lr, decay_mult, b1, one_m_b1, b2, one_m_b2, gm = lion_scalars(
        lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, wd_bits, mgn_bits, HAS_LR,
        HAS_SCALE, HAS_NORM, MAXIMIZE)

    # ---- elements ------------------------------------------------------------------------------
    offs, mask, w, g = load_block(p_ptr, g_ptr, master_ptr, n, DT, MODE, BLOCK)
    g = g * gm
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    w, m = lion_element(w, g, m, lr, decay_mult, b1, one_m_b1, b2, one_m_b2)
    tl.store(m_ptr + offs, m, mask=mask)
    ti = step_number(step_ptr).to(tl.int64)  # the stochastic-rounding draw of step t
    store_weight(w, p_ptr, master_ptr, offs, mask, seed, ti, stream, DT, MODE)


@on_tensors_device
def lion_step_(params, grads, exp_avgs, masters, steps, *, lr, lr_tensor, beta1, beta2, weight_decay,
               maximize, master_mode, grad_scale=None, found_inf=None, norm_sq=None,
               max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    if not params:
        return
    lion_operands("lion_step_", params, grads, exp_avgs, masters, steps, master_mode=master_mode,
                  lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf,
                  norm_sq=norm_sq, param_ids=param_ids, elem_offsets=elem_offsets, values=True)
    streams = sr_streams(len(params), param_ids, elem_offsets)
    seed_u64 = int(seed) & M64
    hyper_bits = [f64_bits(x) for x in (lr, beta1, beta2, weight_decay, max_grad_norm)]

    def launch(i, mode, ops):
        pp, gg, mm, ww = ops
        dummy = mm  # stands in for absent pointers (never dereferenced)
        scalars, has = scalar_operands(dummy, lr_tensor, grad_scale, found_inf, norm_sq,
                                       max_grad_norm)
        n = pp.numel()
        _lion_kernel[(triton.cdiv(n, BLOCK),)](
            as_kernel_arg(pp), as_kernel_arg(gg), mm, ww if ww is not None else dummy, steps[i],
            *scalars, n, *hyper_bits, seed_u64, i64_bits(streams[i]), DT=DTYPE_CODE[pp.dtype],
            MODE=mode, MAXIMIZE=bool(maximize), **has, **launch_options())

    for_each_tensor(params, grads, [exp_avgs], masters, master_mode, launch)
    advance_steps(steps, found_inf)
