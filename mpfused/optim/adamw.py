"""``mpfused.AdamW`` and ``mpfused.Adam``: drop-ins for ``torch.optim.AdamW`` / ``torch.optim.Adam``
that train fp32, fp16 or bf16 parameters with one fused multi-tensor kernel per (device, dtype).

fp16/bf16 parameters keep their fp32 value in ``optimizer.state[p]`` (checkpointed with it):

* ``master_weights="fp32"`` (default): ``state["master"]`` fp32 (4 B/param); the param is the
  master rounded to nearest after every step.
* ``master_weights="remainder"`` (bf16 only): ``state["master_remainder"]`` int16 low half of
  the fp32 master (2 B/param); exact, but the optimizer must be the only writer of the params.
* ``master_weights="remainder8"`` (bf16 only): ``state["master_remainder8"]`` int8 correction
  (1 B/param): bits 8..15 of the master rounded to 24 bits (16 significant bits), the param its
  top half rounded to nearest; updates below 2^-17..2^-16 of |w| are rounded away (README,
  "Master modes").
* ``master_weights="none"``: no master; bf16 params use stochastic rounding, fp16 params round
  to nearest.

Moments are fp32 for every param dtype. With a GradScaler (mpfused's or torch's) the kernel reads
``grad_scale`` and ``found_inf`` on device: grads are unscaled in registers (not written back)
and a step with found_inf > 0 changes nothing (params, masters, moments, step counters).
``max_grad_norm=`` fuses gradient clipping into the same kernel.
"""
from __future__ import annotations

import torch

from mpfused.device_copy import copy_to
from mpfused.ops import adam as adam_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._args import check_impl_flags, check_mpfused_args, check_torch_args
from mpfused.optim.engine import MASTER_MODES, FusedOptimizer, _local

__all__ = ["AdamW", "Adam", "MASTER_MODES"]


class AdamW(FusedOptimizer):
    _BNB_STATE_KEYS = ("exp_avg", "exp_avg_sq")  # bitsandbytes 32-bit state1/state2 (engine.py)
    _decoupled = True
    _GROUP_DEFAULTS = {**FusedOptimizer._GROUP_DEFAULTS, "amsgrad": False}

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, capturable: bool = False,
                 master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0, foreach=None, fused=None,
                 differentiable: bool = False, decoupled_weight_decay: bool | None = None):
        betas = check_torch_args(lr, betas, eps, weight_decay, foreach, capturable)
        check_mpfused_args(lr, eps, weight_decay, max_grad_norm)
        self._check_master_weights(master_weights)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled
        elif self._decoupled and not decoupled_weight_decay:
            raise ValueError(f"mpfused.{type(self).__name__} always decouples weight decay; use "
                             "mpfused.Adam for L2 weight decay")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, capturable=capturable, master_weights=master_weights,
                        foreach=foreach, fused=fused, differentiable=False,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)
        check_impl_flags(fused, foreach, differentiable)  # after super().__init__, as torch
        self._setup_engine(max_grad_norm, backend, seed)

    def _fix_group(self, group) -> None:
        # as torch: AdamW always decouples (also when an Adam state_dict is loaded into it)
        if self._decoupled:
            group["decoupled_weight_decay"] = True
        else:
            group.setdefault("decoupled_weight_decay", False)

    # ---- state and operands -------------------------------------------------------------------
    def _init_state(self, group, p) -> None:
        """Step and moments of a param without state; _sync_state_keys adds what the group's
        options need (masters, max_exp_avg_sq)."""
        state = self._start_state(group, p)
        if state is None:
            return
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _plan_extra(self, group) -> tuple:
        return (group["amsgrad"], group["master_weights"])

    def _sync_extra_state(self, group, p) -> None:
        state = self.state[p]
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                       memory_format=torch.preserve_format)

    def _fill_operands(self, group, b, st) -> None:
        s = b.state
        s["exp_avgs"] = [_local(x["exp_avg"]) for x in st]
        s["exp_avg_sqs"] = [_local(x["exp_avg_sq"]) for x in st]
        s["max_exp_avg_sqs"] = [_local(x["max_exp_avg_sq"]) for x in st] if group["amsgrad"] else []
        s["step_"] = BoundOp(adam_ops.adam_step_, [
            s["local_params"], s["exp_avgs"], s["exp_avg_sqs"], s["max_exp_avg_sqs"],
            s["masters"], s["steps"]], s["param_ids"], s["elem_offsets"])

    # ---- step -------------------------------------------------------------------------------
    def _hyper(self, group, device) -> dict:
        return _hyper(group, device)

    def _launch_args(self, b, group, hyper, scaling) -> tuple[tuple, dict]:
        """adam_step_'s scalars: lr, lr_tensor, beta1, beta2, eps, weight_decay in `hyper`,
        grad_scale, found_inf, norm_sq, max_grad_norm, seed in `scaling`; no operands."""
        return (), dict(hyper, amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                        decoupled=bool(group["decoupled_weight_decay"]),
                        master_mode=b.state["mode"], **scaling)


class Adam(AdamW):
    """``torch.optim.Adam`` semantics: L2 weight decay added to the gradient, default 0
    (``decoupled_weight_decay=True``: AdamW's decay, as in torch)."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def _hyper(group, device) -> dict:
    """lr, lr_tensor, beta1, beta2, eps, weight_decay as the ops take them (keywords): a tensor
    lr is read on the device by the kernel, a float one passed as a scalar."""
    lr = group["lr"]
    beta1, beta2 = group["betas"]
    tensor_lr = isinstance(lr, torch.Tensor)
    return dict(lr=0.0 if tensor_lr else float(lr),
                lr_tensor=copy_to(lr, device) if tensor_lr else None, beta1=float(beta1),
                beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]))

