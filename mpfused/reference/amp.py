"""Reference loss-scaling ops (float64 math)."""
from __future__ import annotations

import math

import torch


def _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write_back):
    inv = inv_scale.double().reshape(())
    total = torch.zeros((), dtype=torch.float64, device=found_inf.device)
    bad = torch.zeros((), dtype=torch.bool, device=found_inf.device)
    for i, g in enumerate(grads):
        if g.layout != torch.strided:
            raise RuntimeError(f"mpfused: grads[{i}] must be a dense (strided) tensor; sparse "
                               "tensors are not supported (check grad._values() instead)")
        if g.numel() == 0:
            continue
        g64 = g.double()
        u = g64 * inv
        bad |= ~torch.isfinite(u.float()).all()  # the unscaled value, in the kernels' fp32
        if write_back:
            g.copy_(u)
        if norm_sq is not None or norm_sq_per_tensor is not None:
            s = (u * u).sum()
            total += s
            if norm_sq_per_tensor is not None:
                norm_sq_per_tensor[i] += s.to(norm_sq_per_tensor.dtype)
    found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if norm_sq is not None:
        norm_sq.add_(total.to(norm_sq.dtype))


def unscale_grads_(grads, found_inf, inv_scale, *, norm_sq=None, norm_sq_per_tensor=None):
    _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write_back=True)


def check_grads(grads, found_inf, inv_scale, *, norm_sq=None, norm_sq_per_tensor=None):
    _check(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, write_back=False)


def update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor,
                  backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
                  consecutive_hysteresis=False):
    """The rule of csrc/include/mpfused/amp_math.h, on host scalars (syncs: reference only)."""
    s, g, h = float(scale.item()), int(growth_tracker.item()), int(hysteresis_tracker.item())
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    if found_inf.item() > 0:
        g = 0
        h -= 1
        if hysteresis <= 1 or h <= 0:
            s = f32(s * backoff_factor)
            if min_scale > 0:
                s = max(s, min_scale)
            h = max(h, 0)
        h = hysteresis if hysteresis <= 1 else h
    else:
        if consecutive_hysteresis:
            h = hysteresis
        if g + 1 == growth_interval:
            grown = f32(s * growth_factor)
            if math.isfinite(grown):
                s = min(grown, max_scale)
            g, h = 0, hysteresis
        else:
            g += 1
    scale.fill_(s)
    growth_tracker.fill_(g)
    hysteresis_tracker.fill_(h)
