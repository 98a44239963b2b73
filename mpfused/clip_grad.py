"""``mpfused.clip_grad_norm_``: drop-in for ``torch.nn.utils.clip_grad_norm_`` whose 2-norm comes
from the fused multi-tensor check pass (one read per grad, all dtypes of a device in one call) and
whose scaling is the fused unscale kernel. No host sync unless ``error_if_nonfinite=True``."""
from __future__ import annotations

import torch

from mpfused.ops import amp as amp_ops


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None, *,
                    backend: str | None = None) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if float(norm_type) != 2.0 or any(g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)
    if not grads:
        return torch.tensor(0.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first = grads[0].device
    total_sq = torch.zeros((), dtype=torch.float32, device=first)
    for device, gs in by_device.items():
        sq = torch.zeros((), dtype=torch.float32, device=device)
        amp_ops.check_grads(gs, torch.zeros((), device=device), torch.ones((), device=device), sq,
                            None, backend=backend)
        total_sq += sq.to(first, non_blocking=True)
    total_norm = total_sq.sqrt()
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for device, gs in by_device.items():
        amp_ops.unscale_grads_(gs, torch.zeros((), device=device), clip_coef.to(device), None,
                               None, backend=backend)
    return total_norm
