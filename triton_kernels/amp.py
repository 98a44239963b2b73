"""Triton loss-scaling kernels: non-finite check (+ unscale, + sum of squares), scale update.
One launch per tensor (no pointer tables: they are not portable to the interpreter); partial sums
are written per program and reduced in a fixed order, so norms are deterministic."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpfused.operand_checks import check_amp
from mpfused.triton_kernels._bits import (DTYPE_CODE, as_kernel_arg, f64_bits, f64_from_bits,
                                          is_nonfinite, load_f32, num_warps_for, store_f32)
from mpfused.triton_kernels._device import on_tensors_device

BLOCK = 4096


@triton.jit
def _check_kernel(x_ptr, n, inv_ptr, found_ptr, partial_ptr, DT: tl.constexpr,
                  WRITE: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit indexing
    mask = offs < n
    x = load_f32(x_ptr, offs, mask, DT)
    u = x * tl.load(inv_ptr)
    bad = tl.max(tl.where(mask & is_nonfinite(u), 1, 0), axis=0)  # the unscaled value (amp_math.h)
    if bad > 0:
        tl.store(found_ptr, 1.0)
    if WRITE:
        store_f32(x_ptr, offs, u, mask, DT)
    if NORM:
        tl.store(partial_ptr + pid, tl.sum(tl.where(mask, u * u, 0.0), axis=0))


def _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write):
    check_amp("unscale_grads_" if write else "check_grads", grads, found_inf, inv_scale, norm_sq,
              norm_sq_per_tensor, values=True)
    norm = norm_sq is not None or norm_sq_per_tensor is not None
    total = None
    for i, g in enumerate(grads):
        if g.numel() == 0:
            continue
        x = g if g.is_contiguous() else g.contiguous()
        grid = (triton.cdiv(x.numel(), BLOCK),)
        partial = torch.empty(grid[0] if norm else 1, dtype=torch.float32, device=g.device)
        _check_kernel[grid](as_kernel_arg(x), x.numel(), inv_scale, found_inf, partial,
                            DT=DTYPE_CODE[g.dtype], WRITE=write, NORM=norm, BLOCK=BLOCK,
                            num_warps=num_warps_for(BLOCK),
                            enable_fp_fusion=False)  # no FMA contraction: rounds as interpreted
        if write and x is not g:
            g.copy_(x)
        if norm:
            s = partial.double().sum()
            total = s if total is None else total + s
            if norm_sq_per_tensor is not None:
                norm_sq_per_tensor[i] += s.float()
    if norm_sq is not None and total is not None:
        norm_sq += total.float()


@on_tensors_device
def unscale_grads_(grads, found_inf, inv_scale, *, norm_sq=None, norm_sq_per_tensor=None):
    _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write=True)


@on_tensors_device
def check_grads(grads, found_inf, inv_scale, *, norm_sq=None, norm_sq_per_tensor=None):
    _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write=False)


@triton.jit(do_not_specialize=["growth_bits", "backoff_bits"])
def _update_scale_kernel(scale_ptr, growth_ptr, hyst_ptr, found_ptr, growth_bits, backoff_bits,
                         growth_interval, hysteresis, min_scale, max_scale, consecutive):
    # Single program; the rule of csrc/include/mpfused/amp_math.h::update_scale.
    scale = tl.load(scale_ptr)
    g = tl.load(growth_ptr)
    h = tl.load(hyst_ptr)
    if tl.load(found_ptr) > 0.0:
        h2 = h - 1
        if (hysteresis <= 1) | (h2 <= 0):
            s = (scale.to(tl.float64) * f64_from_bits(backoff_bits)).to(tl.float32)
            if min_scale > 0.0:
                s = tl.maximum(s, min_scale)
            tl.store(scale_ptr, s)
            h2 = tl.maximum(h2, 0)
        if hysteresis <= 1:
            h2 = hysteresis
        tl.store(growth_ptr, 0)
        tl.store(hyst_ptr, h2)
    else:
        if consecutive:
            tl.store(hyst_ptr, hysteresis)
        if g + 1 == growth_interval:
            grown = (scale.to(tl.float64) * f64_from_bits(growth_bits)).to(tl.float32)
            if not is_nonfinite(grown):
                tl.store(scale_ptr, tl.minimum(grown, max_scale))
            tl.store(growth_ptr, 0)
            tl.store(hyst_ptr, hysteresis)
        else:
            tl.store(growth_ptr, g + 1)


@on_tensors_device
def update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor,
                  backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
                  consecutive_hysteresis=False):
    _update_scale_kernel[(1,)](scale, growth_tracker, hysteresis_tracker, found_inf,
                               f64_bits(growth_factor), f64_bits(backoff_factor),
                               int(growth_interval), int(hysteresis), float(min_scale),
                               float(max_scale), int(bool(consecutive_hysteresis)),
                               enable_fp_fusion=False)
