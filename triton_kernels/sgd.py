"""Triton multi-tensor SGD step (the op mpfused::sgd_step_): the math of
csrc/include/mpfused/sgd_math.h, one launch per non-empty tensor (host side: _elementwise.py).

Numerics, as the native kernels: per-tensor scalars formed once per program as sgd_scalars does
(lr, weight_decay and momentum rounded to fp32 from their fp64 values, 1 - dampening derived in
fp64 and rounded once; fp64 arguments travel exactly, as bit patterns: _bits.f64_bits; the grad
multiplier and a tensor lr from _step_scalars), then sgd_element in fp32 in torch's order with no
FMA contraction (enable_fp_fusion=False: compiled and interpreted runs round alike). The master
modes, stochastic rounding included, are _master.load_weight / store_weight.

A tensor whose step counter is 0 takes its first step: its momentum buffer becomes the gradient
itself (torch clones it), decided per tensor on device. momentum == 0 compiles without buffers
(MOMENTUM); nothing reads the step counters, found_inf, grad_scale, norm_sq or a tensor lr on the
host, and a skipped step (found_inf > 0) touches nothing, step counters included.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, f64_from_bits,
                                          i64_bits)
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.operand_checks import sgd_operands
from mpfused.triton_kernels._elementwise import (BLOCK, M64, advance_steps, for_each_tensor,
                                                 launch_options, scalar_operands)
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import load_block, step_skipped
from mpfused.triton_kernels._step_scalars import grad_multiplier, read_lr, step_number


@triton.jit
def sgd_element(w, g, buf, lr, wd, momentum, one_m_damp, first, MOMENTUM: tl.constexpr,
                NESTEROV: tl.constexpr):
    """sgd_math.h::sgd_element on a block (g already times the grad multiplier): (w, buf)."""
    g = tl.where(wd != 0.0, g + wd * w, g)  # L2 term only when nonzero (an inf w stays out)
    if MOMENTUM:
        buf = tl.where(first, g, momentum * buf + one_m_damp * g)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    return w - lr * g, buf


@triton.jit
def sgd_scalars(step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, momentum_bits, dampening_bits,
                wd_bits, mgn_bits, HAS_LR: tl.constexpr, HAS_SCALE: tl.constexpr,
                HAS_NORM: tl.constexpr, MAXIMIZE: tl.constexpr):
    """sgd_math.h::sgd_scalars, per tensor: (t, lr, wd, momentum, 1 - dampening, grad
    multiplier); t in fp64, the rest fp32."""
    t = step_number(step_ptr)
    lr = read_lr(lr_ptr, lr_bits, HAS_LR).to(tl.float32)
    wd = f64_from_bits(wd_bits).to(tl.float32)
    momentum = f64_from_bits(momentum_bits).to(tl.float32)
    one_m_damp = (1.0 - f64_from_bits(dampening_bits)).to(tl.float32)
    gm = grad_multiplier(scale_ptr, norm_ptr, mgn_bits, HAS_SCALE, HAS_NORM, MAXIMIZE)
    return t, lr, wd, momentum, one_m_damp, gm


@triton.jit(do_not_specialize=["lr_bits", "momentum_bits", "dampening_bits", "wd_bits",
                               "mgn_bits", "seed", "stream"])
def _sgd_kernel(p_ptr, g_ptr, buf_ptr, master_ptr, step_ptr, lr_ptr, scale_ptr, found_ptr,
                norm_ptr, n, lr_bits, momentum_bits, dampening_bits, wd_bits, mgn_bits, seed,
                stream, DT: tl.constexpr, MODE: tl.constexpr, MOMENTUM: tl.constexpr,
                NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_LR: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr,
                BLOCK: tl.constexpr):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return

    # ---- per-tensor scalars ---------------------------------------------------------------------
    t, lr, wd, momentum, one_m_damp, gm = sgd_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, momentum_bits, dampening_bits, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE)
    first = t <= 1.0

    # ---- elements ------------------------------------------------------------------------------
    offs, mask, w, g = load_block(p_ptr, g_ptr, master_ptr, n, DT, MODE, BLOCK)
    g = g * gm
    buf = g  # no buffer without MOMENTUM
    if MOMENTUM:
        buf = tl.load(buf_ptr + offs, mask=mask, other=0.0)
    w, buf = sgd_element(w, g, buf, lr, wd, momentum, one_m_damp, first, MOMENTUM, NESTEROV)
    if MOMENTUM:
        tl.store(buf_ptr + offs, buf, mask=mask)
    store_weight(w, p_ptr, master_ptr, offs, mask, seed, t.to(tl.int64), stream, DT, MODE)


@on_tensors_device
def sgd_step_(params, grads, momentum_buffers, masters, steps, *, lr, lr_tensor, momentum, dampening,
              weight_decay, nesterov, maximize, master_mode, grad_scale=None, found_inf=None,
              norm_sq=None, max_grad_norm=0.0, seed=0, param_ids=(), elem_offsets=()):
    if not params:
        return
    sgd_operands("sgd_step_", params, grads, momentum_buffers, masters, steps, momentum=momentum,
                 master_mode=master_mode, lr_tensor=lr_tensor, grad_scale=grad_scale,
                 found_inf=found_inf, norm_sq=norm_sq, param_ids=param_ids,
                 elem_offsets=elem_offsets, values=True)
    has_momentum = momentum != 0
    streams = sr_streams(len(params), param_ids, elem_offsets)
    seed_u64 = int(seed) & M64
    hyper_bits = [f64_bits(x) for x in (lr, momentum, dampening, weight_decay, max_grad_norm)]

    def launch(i, mode, ops):
        pp, gg, bb, ww = ops
        dummy = steps[i]  # fp32, stands in for absent pointers (never dereferenced)
        scalars, has = scalar_operands(dummy, lr_tensor, grad_scale, found_inf, norm_sq,
                                       max_grad_norm)
        n = pp.numel()
        _sgd_kernel[(triton.cdiv(n, BLOCK),)](
            as_kernel_arg(pp), as_kernel_arg(gg), bb if bb is not None else dummy,
            ww if ww is not None else dummy, steps[i], *scalars, n, *hyper_bits, seed_u64,
            i64_bits(streams[i]), DT=DTYPE_CODE[pp.dtype], MODE=mode, MOMENTUM=has_momentum,
            NESTEROV=bool(nesterov) and has_momentum, MAXIMIZE=bool(maximize), **has,
            **launch_options())

    for_each_tensor(params, grads, [momentum_buffers if has_momentum else None], masters,
                    master_mode, launch)
    advance_steps(steps, found_inf)
