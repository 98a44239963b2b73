"""Triton multi-tensor Adam/AdamW step: the math of csrc/include/mpfused/adam_math.h, one launch per
non-empty tensor (no pointer tables: they are not portable to the interpreter).

Sync-free: the step counters, lr_tensor, grad_scale, found_inf and norm_sq are read on device,
inside the kernel. A program returns at once when found_inf > 0, and the step counters advance by
(found_inf <= 0) with one foreach op, so a skipped step changes nothing at all.

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

Layouts: 64-bit offsets. A tensor whose operands are all dense with the param's strides is updated
in place in memory order (except stochastic rounding, which needs the logical order: contiguous
operands); any other is staged through contiguous copies, written back after the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpfused.triton_kernels._adam_scalars import adam_scalars
from mpfused.triton_kernels._master import load_weight, store_weight
from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, i64_bits, load_f32,
                                          num_warps_for)
from mpfused.triton_kernels._device import on_tensors_device

BLOCK = 2048
_M64 = (1 << 64) - 1
_NO_MASTER, _FP32_MASTER, _REMAINDER, _STOCHASTIC = 0, 1, 2, 3


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "wd_bits", "mgn_bits",
                               "seed", "stream"])
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, step_ptr, lr_ptr, scale_ptr,
                 found_ptr, norm_ptr, n, lr_bits, beta1_bits, beta2_bits, eps, wd_bits, mgn_bits,
                 seed, stream, DT: tl.constexpr, MODE: tl.constexpr, AMSGRAD: tl.constexpr,
                 DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_LR: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, HAS_NORM: tl.constexpr,
                 BLOCK: tl.constexpr):
    if HAS_FOUND:
        if tl.load(found_ptr) > 0.0:  # skipped step: nothing is touched
            return

    # ---- per-tensor scalars (adam_math.h::adam_scalars) ---------------------------------------
    ti, b2, eps32, one_m_b1, one_m_b2, step_size, inv_bc2_sqrt, gm, decay, l2 = adam_scalars(
        step_ptr, lr_ptr, scale_ptr, norm_ptr, lr_bits, beta1_bits, beta2_bits, eps, wd_bits,
        mgn_bits, HAS_LR, HAS_SCALE, HAS_NORM, MAXIMIZE, DECOUPLED)

    # ---- elements (adam_math.h::adam_element) -------------------------------------------------
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit indexing
    mask = offs < n
    w = load_weight(p_ptr, master_ptr, offs, mask, DT, MODE)
    g = load_f32(g_ptr, offs, mask, DT)
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


def _kernel_mode(dtype: torch.dtype, master_mode: int) -> int:
    # As the CPU kernel's pick_kernel: fp32 params are their own master; fp16 params have either
    # an fp32 master or none (round to nearest); bf16 params take every mode.
    if dtype == torch.float32:
        return _NO_MASTER
    if dtype == torch.float16:
        return _FP32_MASTER if master_mode == _FP32_MASTER else _NO_MASTER
    return master_mode if master_mode in (_FP32_MASTER, _REMAINDER, _STOCHASTIC) else _NO_MASTER


def _check(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, amsgrad,
           master_mode, lr_tensor, grad_scale, found_inf, norm_sq):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("steps", steps)):
        if len(lst) != n:
            raise RuntimeError(f"mpfused: adam_step_: {name} has {len(lst)} tensors, params {n}")
    if amsgrad and len(max_exp_avg_sqs) != n:
        raise RuntimeError("mpfused: amsgrad needs one max_exp_avg_sq per param")
    dev = params[0].device
    for name, t in [("lr_tensor", lr_tensor), ("grad_scale", grad_scale), ("found_inf", found_inf),
                    ("norm_sq", norm_sq)] + [(f"steps[{i}]", t) for i, t in enumerate(steps)]:
        if t is not None and (t.device != dev or t.numel() != 1):
            raise RuntimeError(f"mpfused: {name} must be a 1-element tensor on {dev} (the "
                               f"params' device), got {tuple(t.shape)} on {t.device}")
    want_master = {_FP32_MASTER: torch.float32, _REMAINDER: torch.int16}.get(int(master_mode))
    for i, p in enumerate(params):
        if p.dtype not in DTYPE_CODE:
            raise RuntimeError(f"mpfused: params[{i}] must be float32, float16 or bfloat16, got {p.dtype}")
        if grads[i].dtype != p.dtype:
            raise RuntimeError(f"mpfused: grads[{i}] must have its param's dtype {p.dtype}, got "
                               f"{grads[i].dtype}")
        ops = [("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])]
        if amsgrad:
            ops.append(("max_exp_avg_sqs", max_exp_avg_sqs[i]))
        mode = _kernel_mode(p.dtype, int(master_mode))
        if mode in (_FP32_MASTER, _REMAINDER):
            if len(masters) != n:
                raise RuntimeError("mpfused: adam_step_: one master per param is required")
            if masters[i].dtype != want_master:
                raise RuntimeError(f"mpfused: masters[{i}] must be {want_master}, got {masters[i].dtype}")
            ops.append(("masters", masters[i]))
        for name, t in [("params", p)] + ops:
            if t.layout != torch.strided:
                raise RuntimeError(f"mpfused: {name}[{i}] is sparse; mpfused optimizers support "
                                   "dense tensors only")
            if name == "params":
                continue
            if name not in ("grads", "masters") and t.dtype != torch.float32:
                raise RuntimeError(f"mpfused: {name}[{i}] must be torch.float32, got {t.dtype}")
            if t.numel() != p.numel() or t.device != p.device:
                raise RuntimeError(f"mpfused: {name}[{i}] differs from params[{i}] in size or device")


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill [data_ptr, data_ptr + numel) in some order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _stage(tensors, mutated, logical_order):
    """Kernel operands of one tensor: in place when every operand is dense with the param's
    strides (and, for stochastic rounding, in logical order), else contiguous copies; returns
    (operands, write-backs)."""
    p = tensors[0]
    present = [t for t in tensors if t is not None]
    if logical_order:
        direct = all(t.is_contiguous() for t in present)
    else:
        direct = all(_dense(t) and t.stride() == p.stride() for t in present)
    if direct:
        return list(tensors), []
    out, back = [], []
    for t, mut in zip(tensors, mutated):
        if t is None:
            out.append(None)
            continue
        c = t.contiguous()
        out.append(c)
        if mut and c is not t:
            back.append((t, c))
    return out, back


@on_tensors_device
def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, lr,
               lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled,
               master_mode, grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0,
               seed=0, param_ids=(), elem_offsets=()):
    if not params:
        return
    _check(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, amsgrad,
           master_mode, lr_tensor, grad_scale, found_inf, norm_sq)
    streams = sr_streams(len(params), param_ids, elem_offsets)
    has_norm = norm_sq is not None and max_grad_norm > 0
    seed_u64 = int(seed) & _M64
    b1_bits, b2_bits, mgn_bits = f64_bits(beta1), f64_bits(beta2), f64_bits(max_grad_norm)
    lr_bits, wd_bits = f64_bits(lr), f64_bits(weight_decay)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        mode = _kernel_mode(p.dtype, int(master_mode))
        master = masters[i] if mode in (_FP32_MASTER, _REMAINDER) else None
        vmax = max_exp_avg_sqs[i] if amsgrad else None
        ops, back = _stage([p, grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, master],
                           [True, False, True, True, True, True], logical_order=mode == _STOCHASTIC)
        pp, gg, mm, vv, vm, ww = ops
        dummy = mm  # stands in for absent pointers (never dereferenced)
        n = pp.numel()
        grid = (triton.cdiv(n, BLOCK),)
        _adam_kernel[grid](
            as_kernel_arg(pp), as_kernel_arg(gg), mm, vv, vm if vm is not None else dummy,
            ww if ww is not None else dummy, steps[i],
            lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            norm_sq if has_norm else dummy,
            n, lr_bits, b1_bits, b2_bits, float(eps), wd_bits, mgn_bits,
            seed_u64, i64_bits(streams[i]),
            DT=DTYPE_CODE[p.dtype], MODE=mode, AMSGRAD=bool(amsgrad), DECOUPLED=bool(decoupled),
            MAXIMIZE=bool(maximize), HAS_LR=lr_tensor is not None,
            HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None,
            HAS_NORM=has_norm, BLOCK=BLOCK, num_warps=num_warps_for(BLOCK),
            enable_fp_fusion=False)  # no FMA contraction: interpreted and compiled runs agree
        for orig, staged in back:
            orig.copy_(staged)  # a skipped step wrote nothing: the copy-back restores the same
    # Step counters advance only on a taken step, decided on device (no host sync).
    if found_inf is None:
        torch._foreach_add_(list(steps), 1)
    else:
        taken = (found_inf.reshape(()) <= 0).to(steps[0].dtype)
        torch._foreach_add_(list(steps), taken)
