"""``mpfused.Lion``: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms") with decoupled weight decay, as bitsandbytes' 32-bit ``Lion`` and lion-pytorch
compute it, on fp32, fp16 or bf16 parameters with one fused multi-tensor kernel per (device,
dtype), the engine's master weights, GradScaler protocol and fused clipping.

Update (csrc/include/mpfused/lion_math.h): ``w *= 1 - lr*wd; c = b1*m + (1-b1)*g;
w -= lr * sign(c); m = b2*m + (1-b2)*g``. ``sign(0) = 0`` (torch.sign, lion-pytorch and
bitsandbytes agree: an exactly balanced c moves nothing) and a NaN stays NaN (never a silent
zero step). State per param: ``exp_avg`` (fp32), ``step`` (seeds stochastic rounding) and the
masters of 16-bit params.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from mpfused.device_copy import copy_to
from mpfused.ops import lion as lion_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._args import check_impl_flags, check_mpfused_args
from mpfused.optim.engine import FusedOptimizer, _local

__all__ = ["Lion"]


class Lion(FusedOptimizer):
    _BNB_STATE_KEYS = ("exp_avg",)  # bitsandbytes 32-bit state1/state2 (engine.py)
    def __init__(self, params, lr: float | Tensor = 1e-4, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False,
                 master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0, foreach=None, fused=None,
                 differentiable: bool = False):
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta <= 1.0 or not math.isfinite(float(beta)):
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        check_mpfused_args(lr, 0.0, weight_decay, max_grad_norm)
        self._check_master_weights(master_weights)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize,
                        capturable=False, master_weights=master_weights, foreach=foreach,
                        fused=fused, differentiable=False)
        super().__init__(params, defaults)
        check_impl_flags(fused, foreach, differentiable)
        self._setup_engine(max_grad_norm, backend, seed)

    def _init_state(self, group, p) -> None:
        state = self._start_state(group, p)
        if state is not None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                                memory_format=torch.preserve_format)

    def _fill_operands(self, group, b, st) -> None:
        s = b.state
        s["exp_avgs"] = [_local(x["exp_avg"]) for x in st]
        s["step_"] = BoundOp(lion_ops.lion_step_, [s["local_params"], s["exp_avgs"],
                                                   s["masters"], s["steps"]],
                             s["param_ids"], s["elem_offsets"])

    def _hyper(self, group, device) -> dict:
        """lr, lr_tensor, beta1, beta2, weight_decay as lion_step_ takes them (keywords)."""
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        tensor_lr = isinstance(lr, Tensor)
        return dict(lr=0.0 if tensor_lr else float(lr),
                    lr_tensor=copy_to(lr, device) if tensor_lr else None, beta1=float(beta1),
                    beta2=float(beta2), weight_decay=float(group["weight_decay"]))

    def _launch_args(self, b, group, hyper, scaling) -> tuple[tuple, dict]:
        return (), dict(hyper, maximize=bool(group["maximize"]), master_mode=b.state["mode"],
                        **scaling)
