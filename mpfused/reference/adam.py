"""Reference Adam/AdamW step (float64 math, results stored in each tensor's dtype)."""
from __future__ import annotations

import math

import torch

from mpfused import master_modes
from mpfused.master_modes import FP32_MASTER, MASTER_DTYPE, REMAINDER, REMAINDER8, STOCHASTIC

_M64 = (1 << 64) - 1


def _u64(x: int) -> int:
    return x & _M64


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def sr_stream(param_id: int, elem_offset: int = 0) -> int:
    """csrc/include/mpfused/adam_math.h::sr_stream: the stochastic-rounding stream of a tensor."""
    return _u64(0x9E3779B97F4A7C15 * (param_id + 1) + elem_offset * 0xBF58476D1CE4E5B9)


def sr_streams(n: int, param_ids, elem_offsets) -> list[int]:
    """Each of n tensors' sr_stream from the ops' param_ids / elem_offsets (empty: position i,
    offset 0), checked as the native bindings check them."""
    for name, lst in (("param_ids", param_ids), ("elem_offsets", elem_offsets)):
        if len(lst) not in (0, n):
            raise RuntimeError(f"mpfused: {name} must be empty or have one entry per param ({n}), "
                               f"got {len(lst)}")
        if any(int(x) < 0 for x in lst):
            raise RuntimeError(f"mpfused: param_ids and elem_offsets must be >= 0, got {list(lst)}")
    return [sr_stream(int(param_ids[i]) if len(param_ids) else i,
                      int(elem_offsets[i]) if len(elem_offsets) else 0) for i in range(n)]


def random16(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """csrc/include/mpfused/adam_math.h::random16 on int64 tensors (wrapping arithmetic)."""
    base = _to_signed(_u64(seed + stream))
    z = index.to(torch.int64) * _to_signed(0xBF58476D1CE4E5B9) + base

    def lshr(x, k):  # logical shift right of a uint64 held in int64
        return (x >> k) & ((1 << (64 - k)) - 1)

    z = (z ^ lshr(z, 30)) * _to_signed(0xBF58476D1CE4E5B9)
    z = (z ^ lshr(z, 27)) * _to_signed(0x94D049BB133111EB)
    z = z ^ lshr(z, 31)
    return lshr(z, 48)


def step_seed(seed: int, t: float) -> int:
    return _u64(seed ^ _u64(int(t) * 0xD1B54A32D192ED03))


def remainder_split(w32: torch.Tensor):
    """fp32 -> (bf16 param, int16 remainder): hi16 rounded to nearest, ties away from zero; a NaN
    becomes the canonical quiet NaN 0x7FC00000 (param 0x7FC0, remainder 0)."""
    bits = w32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, bits)
    lo = bits & 0xFFFF
    hi = ((bits >> 16) + (lo >= 0x8000).to(torch.int64)) & 0xFFFF
    p = (hi - (hi >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16).view(torch.bfloat16)
    rem = (lo - (lo >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)
    return p, rem


def remainder_join(p: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    hi = p.view(torch.int16).to(torch.int64) & 0xFFFF
    hi = (hi - (rem < 0).to(torch.int64)) & 0xFFFF
    bits = (hi << 16) | (rem.to(torch.int64) & 0xFFFF)
    return (bits - (bits >= 0x80000000).to(torch.int64) * (1 << 32)).to(torch.int32).view(torch.float32)


def round_to_24_bits(w32: torch.Tensor) -> torch.Tensor:
    """adam_math.h::round_to_24_bits: the fp32 word rounded to its top 24 bits (to nearest, ties
    to even; overflow to inf; NaN -> 0x7FC00000), as int64 bit patterns."""
    bits = w32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (bits + 0x7F + ((bits >> 8) & 1)) & 0xFFFFFF00
    return torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, r)


def remainder8_split(w32: torch.Tensor):
    """fp32 -> (bf16 param, int8 correction) of the 24-bit master (REMAINDER8): the
    correction is bits 8..15 of w rounded to 24 bits, the param bits 16..31 rounded to nearest,
    ties away from zero."""
    bits = round_to_24_bits(w32)
    lo = (bits >> 8) & 0xFF
    hi = ((bits >> 16) + (lo >= 0x80).to(torch.int64)) & 0xFFFF
    p = (hi - (hi >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16).view(torch.bfloat16)
    rem = (lo - (lo >= 0x80).to(torch.int64) * 0x100).to(torch.int8)
    return p, rem


def remainder8_join(p: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The 24-bit master that bf16 param p and its int8 correction hold, as fp32."""
    hi = p.view(torch.int16).to(torch.int64) & 0xFFFF
    hi = (hi - (rem < 0).to(torch.int64)) & 0xFFFF
    bits = (hi << 16) | ((rem.to(torch.int64) & 0xFF) << 8)
    return (bits - (bits >= 0x80000000).to(torch.int64) * (1 << 32)).to(torch.int32).view(torch.float32)


def bf16_stochastic(w32: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    bits = w32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits + r16) >> 16) & 0xFFFF
    out = (hi - (hi >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(w32), torch.full_like(out, float("nan")), out)


def kernel_mode(p: torch.Tensor, master_mode: int) -> int:
    """The master mode a kernel applies to p (mpfused/master_modes.py's kernel_mode)."""
    return master_modes.kernel_mode(p.dtype, master_mode)


def read_master(p, master, mode) -> torch.Tensor:
    """The fp32 value of a param as float64."""
    if mode == FP32_MASTER:
        return master.double()
    if mode == REMAINDER:
        return remainder_join(p, master).double()
    if mode == REMAINDER8:
        return remainder8_join(p, master).double()
    return p.double()


def write_master(p, master, mode, w32, seed, t, stream) -> None:
    """Store the updated fp32 value w32 into the param (and its master) per the mode."""
    if mode == FP32_MASTER:
        master.copy_(w32)
        p.copy_(w32)
    elif mode == REMAINDER:
        hi, rem = remainder_split(w32.contiguous())
        p.copy_(hi)
        master.copy_(rem)
    elif mode == REMAINDER8:
        hi, rem = remainder8_split(w32.contiguous())
        p.copy_(hi)
        master.copy_(rem)
    elif mode == STOCHASTIC:
        idx = torch.arange(p.numel(), device=p.device).reshape(p.shape)
        p.copy_(bf16_stochastic(w32, random16(step_seed(seed, t), stream, idx)))
    else:
        p.copy_(w32)


def grad_multiplier(grad_scale, norm_sq, max_grad_norm) -> float:
    """inv_scale (an fp32 reciprocal, as the kernels) times the clip coefficient."""
    mult = 1.0
    if grad_scale is not None:
        mult = torch.reciprocal(grad_scale.float().reshape(())).item()
    if norm_sq is not None and max_grad_norm > 0:
        norm = math.sqrt(norm_sq.item())
        mult = torch.tensor(mult * min(1.0, max_grad_norm / (norm + 1e-6)), dtype=torch.float32).item()
    return mult


def param_updates(params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize,
                  decoupled, master_mode, grad_scale, found_inf, norm_sq, max_grad_norm,
                  param_ids=(), elem_offsets=()):
    """The walk every reference Adam step shares: skip on found_inf > 0, advance every step
    counter, and for each non-empty param yield (i, p, t, stream, mode, master, w, g, lr) with w
    the fp32 value (float64) and g the unscaled, clipped, signed grad, weight decay applied
    (AdamW: to w; Adam: L2 into g). `stream` is the param's stochastic-rounding stream
    (sr_stream of param_ids[i], elem_offsets[i]). A tensor lr is read as its float32 value, as
    the kernels read it."""
    if not params:
        return
    streams = sr_streams(len(params), param_ids, elem_offsets)
    if found_inf is not None and found_inf.item() > 0:
        return
    for i, g in enumerate(grads):
        if g is not None and g.layout != torch.strided:
            raise RuntimeError(f"mpfused: grads[{i}] is sparse; mpfused optimizers support dense "
                               "gradients only")
    lr = float(lr_tensor.float().item()) if lr_tensor is not None else float(lr)
    mult = grad_multiplier(grad_scale, norm_sq, max_grad_norm)
    if maximize:
        mult = -mult
    for i, p in enumerate(params):
        t = steps[i].item() + 1
        steps[i].add_(1)
        if p.numel() == 0:
            continue
        mode = kernel_mode(p, master_mode)
        master = masters[i] if mode in MASTER_DTYPE else None
        w = read_master(p, master, mode)
        g = grads[i].double() * mult
        if decoupled:
            w = w * (1 - lr * weight_decay)
        elif weight_decay != 0:
            # as torch and the kernels: no term at all without decay, so a -0 grad stays -0 (an
            # 8-bit state stores its sign) and an inf w adds no 0 * inf = NaN
            g = g + weight_decay * w
        yield i, p, t, streams[i], mode, master, w, g, lr


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, *, lr,
               lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled,
               master_mode, grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0,
               seed=0, param_ids=(), elem_offsets=()):
    for i, p, t, stream, mode, master, w, g, lr in param_updates(
            params, grads, masters, steps, lr, lr_tensor, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, param_ids, elem_offsets):
        m = exp_avgs[i].double()
        m = m + (1 - beta1) * (g - m)
        v = beta2 * exp_avg_sqs[i].double() + (1 - beta2) * g * g
        vv = v
        if amsgrad:
            vv = torch.maximum(max_exp_avg_sqs[i].double(), v)
            max_exp_avg_sqs[i].copy_(vv)
        denom = vv.sqrt() / math.sqrt(1 - beta2**t) + eps
        w = w - (lr / (1 - beta1**t)) * m / denom
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        write_master(p, master, mode, w.float(), seed, t, stream)
