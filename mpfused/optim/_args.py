"""Constructor argument checks of mpfused.AdamW / Adam (and the 8-bit ones): torch.optim.Adam's
checks first, in torch's order with torch's exception types and messages (a drop-in must fail
as torch does), then the few mpfused adds (finite hyperparameters, max_grad_norm)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_torch_args(lr, betas, eps, weight_decay, foreach, capturable) -> tuple:
    """torch.optim.Adam.__init__'s checks before super().__init__; returns betas as torch keeps
    them (tensor betas squeezed to 0-dim)."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, beta in enumerate(betas[:2]):
        if isinstance(beta, Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                                 "and foreach=True")
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    return tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)


def check_mpfused_args(lr, eps, weight_decay, max_grad_norm) -> None:
    """What mpfused adds to torch's checks (runs after them, so every value is a number or a
    1-element tensor): hyperparameters must be finite (torch takes inf, which only yields NaN or
    frozen params), max_grad_norm > 0."""
    for name, value in (("learning rate", lr), ("epsilon value", eps),
                        ("weight_decay value", weight_decay)):
        if not math.isfinite(float(value)):
            raise ValueError(f"Invalid {name}: {value} (mpfused needs a finite value)")
    if max_grad_norm is not None and not (0.0 < float(max_grad_norm) < math.inf):
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be finite and > 0, or "
                         "None for no clipping)")


def check_impl_flags(fused, foreach, differentiable) -> None:
    """torch's checks after super().__init__ (fused with differentiable, then with foreach), then
    mpfused's refusal of differentiable (its kernels have no autograd formula)."""
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        raise RuntimeError("mpfused optimizers do not support `differentiable`")
