"""``mpfused.SGD``: a drop-in for ``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight
decay, maximize, float or tensor lr) that trains fp32, fp16 or bf16 parameters with one fused
multi-tensor kernel per (device, dtype), with the engine's master weights (``master_weights=``
"fp32" / "remainder" / "remainder8" / "none"), GradScaler protocol and fused clipping (``max_grad_norm=``).

State per param: ``momentum_buffer`` (fp32, only when momentum != 0, as torch), ``step`` (a 0-d
fp32 counter torch's SGD does not keep: it makes the first step, whose buffer is the gradient
itself, a device-side decision that a skipped step leaves untaken, and it seeds stochastic
rounding), ``master`` / ``master_remainder`` for 16-bit params as ``mpfused.AdamW``. A
``torch.optim.SGD`` state_dict loads (its buffers count as one step taken) and ours loads into
``torch.optim.SGD`` (which ignores ``step``).

One documented difference: when ``momentum`` is switched from 0 to non-zero on a group that has
already stepped, the new buffer starts at zero (torch starts it at the next gradient); the first
step of a fresh param, and every dampening, Nesterov and maximize setting, are torch's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mpfused.device_copy import copy_to
from mpfused.ops import sgd as sgd_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._args import check_impl_flags, check_mpfused_args
from mpfused.optim.engine import FusedOptimizer, _local

__all__ = ["SGD"]


class SGD(FusedOptimizer):
    _BNB_STATE_KEYS = ("momentum_buffer",)  # bitsandbytes 32-bit state1/state2 (engine.py)
    _GROUP_DEFAULTS = {**FusedOptimizer._GROUP_DEFAULTS, "nesterov": False, "foreach": None,
                       "differentiable": False, "fused": None}

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0, nesterov: bool = False,
                 *, maximize: bool = False, foreach=None, differentiable: bool = False,
                 fused=None, master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0):
        # torch.optim.SGD's checks, in its order, with its exception types and messages
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        check_mpfused_args(lr, 0.0, weight_decay, max_grad_norm)
        self._check_master_weights(master_weights)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=False, fused=fused, capturable=False,
                        master_weights=master_weights)
        super().__init__(params, defaults)
        check_impl_flags(fused, foreach, differentiable)
        self._setup_engine(max_grad_norm, backend, seed)

    # ---- state and operands -------------------------------------------------------------------
    def _adopt_written_state(self, p) -> None:
        state = self.state[p]
        if "momentum_buffer" in state and state["momentum_buffer"] is None:
            del state["momentum_buffer"]  # torch < 2.1 saved None without momentum
        if "step" not in state:  # a torch.optim.SGD state: a buffer means a step was taken
            state["step"] = torch.tensor(1.0 if "momentum_buffer" in state else 0.0,
                                         dtype=torch.float32, device=_local(p).device)
        super()._adopt_written_state(p)

    def _plan_extra(self, group) -> tuple:
        return (group["master_weights"], group["momentum"] != 0)

    def _sync_extra_state(self, group, p) -> None:
        state = self.state[p]
        if group["momentum"] != 0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32,
                                                        memory_format=torch.preserve_format)

    def _fill_operands(self, group, b, st) -> None:
        s = b.state
        s["momentum_buffers"] = ([_local(x["momentum_buffer"]) for x in st]
                                 if group["momentum"] != 0 else [])
        s["step_"] = BoundOp(sgd_ops.sgd_step_, [s["local_params"], s["momentum_buffers"],
                                                 s["masters"], s["steps"]],
                             s["param_ids"], s["elem_offsets"])

    def _adopt_saved_group(self, sg) -> dict:
        if "momentum" in sg or "betas" not in sg:
            return sg
        # bitsandbytes' SGD / SGD8bit group: betas = (momentum, dampening), but it steps without
        # dampening whatever betas[1] says; the loaded run continues as it trained
        return {**{k: v for k, v in sg.items() if k != "betas"},
                "momentum": float(sg["betas"][0]), "dampening": 0.0}

    # ---- step -------------------------------------------------------------------------------
    def _hyper(self, group, device) -> dict:
        """lr, lr_tensor, momentum, dampening, weight_decay as sgd_step_ takes them
        (keywords)."""
        lr = group["lr"]
        tensor_lr = isinstance(lr, Tensor)
        return dict(lr=0.0 if tensor_lr else float(lr),
                    lr_tensor=copy_to(lr, device) if tensor_lr else None,
                    momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]))

    def _launch_args(self, b, group, hyper, scaling) -> tuple[tuple, dict]:
        return (), dict(hyper, nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
                        master_mode=b.state["mode"], **scaling)
