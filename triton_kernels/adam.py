"""Triton multi-tensor Adam/AdamW step: the math of csrc/include/mpfused/adam_math.h, one launch per
non-empty tensor (no pointer tables: they are not portable to the interpreter).

Sync-free: the step counters, lr_tensor, grad_scale, found_inf and norm_sq are read on device,
inside the kernel. A program returns at once when found_inf > 0, and the step counters advance by
(found_inf <= 0) with one foreach op, so a skipped step changes nothing at all (the launch loop,
staging and counters: _elementwise.py; the argument checks: mpfused/operand_checks.py).

Numerics, as the CPU kernel (csrc/cpu/adam_cpu.cpp): per-tensor scalars formed once per program
(fp32 beta2 and eps; 1 - beta1, 1 - beta2, lr * weight_decay, step_size = lr / (1 - beta1^t) and
inv_bc2_sqrt = 1 / sqrt(1 - beta2^t) in fp64, each rounded to fp32 once; lr, betas and weight decay
travel as fp64 bit patterns; grad_mult = fp32 1/grad_scale times the fp64 clip coefficient
rounded to fp32, negated for maximize), then the per-element math in fp32 in adam_element's order,
with correctly rounded sqrt and division and no FMA contraction (enable_fp_fusion=False: compiled
and interpreted runs round alike). One deliberate difference: beta^t uses the fp64 betas (torch's
for-loop and the reference do; the CPU kernel widens the fp32-rounded betas, up to ~1e-5 relative
on the bias corrections; fp64 arguments travel exactly, as bit patterns: _bits.f64_bits). The CPU
kernel's per-ISA clones may contract to FMA, so fp32 results agree with it to a few ulps, not
bitwise. 16-bit stores use integer ops (bf16 round to nearest
even, remainder split with ties away from zero, stochastic rounding from the same splitmix64
stream: the tensor's sr_stream(param_ids[i], elem_offsets[i]), element index = logical
row-major index, so given the same fp32 value the result is bit-identical to the reference's).

Layouts: 64-bit offsets; in place when the operands share the param's dense strides, else staged
through contiguous copies (_elementwise.stage).
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.operand_checks import adam_operands
from mpfused.triton_kernels._adam_scalars import adam_scalars
from mpfused.triton_kernels._master import store_weight
from mpfused.triton_kernels._step_block import load_block, step_skipped
from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import DTYPE_CODE, as_kernel_arg, f64_bits, i64_bits
from mpfused.triton_kernels._device import on_tensors_device
from mpfused.triton_kernels._elementwise import (BLOCK, M64, advance_steps, for_each_tensor,
                                                 launch_options, scalar_operands)


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "seed", "stream"])
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, step_ptr, lr_ptr, scale_ptr,
                 found_ptr, norm_ptr, n, lr_bits, beta1_bits, beta2_bits, eps, wd_bits, mgn_bits,
                 seed, stream, DT: tl.constexpr, MODE: tl.constexpr, AMSGRAD: tl.constexpr,
                 DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_LR: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr,
                 BLOCK: tl.constexpr):
    if step_skipped(found_ptr, HAS_FOUND):  # skipped step: nothing is touched
        return

    # ---- per-tensor scalars (adam_math.h::adam_scalars) ---------------------------------------
    ti, b2, eps32, one_m_b1, one_m_b2, step_size, inv_bc2_sqrt, gm, decay, l2 = adam_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, eps, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE, DECOUPLED)

    # ---- elements (adam_math.h::adam_element) -------------------------------------------------
    offs, mask, w, g = load_block(p_ptr, g_ptr, master_ptr, n, DT, MODE, BLOCK)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    g = g * gm
    if not DECOUPLED:  # Adam's L2 term (when nonzero); AdamW leaves g as it is, like torch
        g = tl.where(l2 != 0.0, g + l2 * w, g)
    w = w - decay * w
    m = m + one_m_b1 * (g - m)
    v = b2 * v + one_m_b2 * (g * g)
    vv = v
    if AMSGRAD:
        vmax = tl.load(vmax_ptr + offs, mask=mask, other=0.0)
        vv = tl.where(vmax > v, vmax, v)  # max_f32
        tl.store(vmax_ptr + offs, vv, mask=mask)
    denom = tl.sqrt_rn(vv) * inv_bc2_sqrt + eps32
    w = w - tl.div_rn(step_size * m, denom)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    store_weight(w, p_ptr, master_ptr, offs, mask, seed, ti, stream, DT, MODE)


@on_tensors_device
def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, *, lr,
               lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled,
               master_mode, grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0,
               seed=0, param_ids=(), elem_offsets=()):
    if not params:
        return
    adam_operands("adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters,
                  steps, amsgrad=amsgrad, master_mode=master_mode, lr_tensor=lr_tensor,
                  grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
                  param_ids=param_ids, elem_offsets=elem_offsets, values=True)
    streams = sr_streams(len(params), param_ids, elem_offsets)
    seed_u64 = int(seed) & M64
    b1_bits, b2_bits, mgn_bits = f64_bits(beta1), f64_bits(beta2), f64_bits(max_grad_norm)
    lr_bits, wd_bits = f64_bits(lr), f64_bits(weight_decay)

    def launch(i, mode, ops):
        pp, gg, mm, vv, vm, ww = ops
        dummy = mm  # stands in for absent pointers (never dereferenced)
        scalars, has = scalar_operands(dummy, lr_tensor, grad_scale, found_inf, norm_sq,
                                       max_grad_norm)
        n = pp.numel()
        _adam_kernel[(triton.cdiv(n, BLOCK),)](
            as_kernel_arg(pp), as_kernel_arg(gg), mm, vv, vm if vm is not None else dummy,
            ww if ww is not None else dummy, steps[i], *scalars,
            n, lr_bits, b1_bits, b2_bits, float(eps), wd_bits, mgn_bits,
            seed_u64, i64_bits(streams[i]),
            DT=DTYPE_CODE[pp.dtype], MODE=mode,
            AMSGRAD=bool(amsgrad), DECOUPLED=bool(decoupled), MAXIMIZE=bool(maximize), **has,
            **launch_options())

    for_each_tensor(params, grads, [exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None],
                    masters, master_mode, launch)
    advance_steps(steps, found_inf)
