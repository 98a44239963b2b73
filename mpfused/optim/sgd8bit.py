"""``mpfused.SGD8bit``: ``mpfused.SGD`` with its momentum buffer in bitsandbytes' block-wise 8-bit
format (``SGD8bit``'s layout: codes into the signed dynamic map, one fp32 absmax per
``block_size`` elements; about 1.02 B/param of state instead of 4), the engine's 8-bit state
(``State8bit``, mpfused/optim/state8bit.py: min_8bit_size / optim_bits / keep_32bit_state rules,
checkpoint format, FSDP2 / DCP) on ``SGD``.

* ``momentum`` must be > 0, as in bitsandbytes' ``SGD8bit`` (the buffer is the only state):
  ``momentum=0`` raises NotImplementedError in the constructor, a group set to it ValueError.
* ``block_size`` (``None``: the format's, 256 as bitsandbytes) and bitsandbytes' legacy
  arguments (accepted, ignored): ``State8bit``'s.
* ``SGD4bit`` (mpfused/optim/sgd4bit.py) is this class with the 4-bit state format: the
  constructor, group rules and flags here serve both.
* Everything else is ``torch.optim.SGD``'s, as ``mpfused.SGD``: the first step's buffer is the
  gradient itself, dampening, Nesterov, L2 weight decay, maximize, float or tensor lr.
  bitsandbytes' SGD8bit ignores ``dampening`` and ``nesterov`` (it steps ``buf = m*buf + g``):
  with ``dampening=0`` and ``nesterov=False`` the two compute the same update.
* Params below ``min_8bit_size`` keep an fp32 ``momentum_buffer`` and take ``sgd_step_``; 8-bit
  params take ``sgd8bit_step_``.
* ``state_dict()`` saves an 8-bit buffer as ``state1`` / ``absmax1``; ``to_torch_state_dict()``
  gives one that ``torch.optim.SGD`` loads (fp32 ``momentum_buffer``), and a ``torch.optim.SGD``
  state_dict loads (quantized). ``to_bitsandbytes_state_dict()`` gives one that
  ``bitsandbytes.optim.SGD8bit`` loads (refused for dampening != 0, Nesterov or maximize, which
  it would not apply), and bitsandbytes' SGD8bit state_dict loads (momentum from its ``betas``,
  dampening 0 as it stepped).
"""
from __future__ import annotations

from torch import Tensor

from mpfused.ops import sgd8bit as sgd8bit_ops
from mpfused.optim.sgd import SGD
from mpfused.optim.state8bit import State8bit

__all__ = ["SGD8bit"]


class SGD8bit(State8bit, SGD):
    _QUANT_STATES = (("momentum_buffer", "signed"),)
    _OP_8BIT = sgd8bit_ops.sgd8bit_step_.op
    _TORCH_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                         "foreach", "differentiable", "fused")

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0, nesterov: bool = False,
                 *, block_size: int | None = None, min_8bit_size: int = 4096,
                 maximize: bool = False, foreach=None, differentiable: bool = False, fused=None,
                 master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0, **legacy):
        if momentum == 0:
            peer = "as bitsandbytes' SGD8bit: " if self._STATE_BITS == 8 else ""
            raise NotImplementedError(
                f"mpfused.{type(self).__name__}: SGD without momentum is not supported ({peer}"
                f"the {self._STATE_BITS}-bit state is the momentum buffer); use mpfused.SGD")
        self._setup_8bit(block_size, min_8bit_size, legacy)
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         maximize=maximize, foreach=foreach, differentiable=differentiable,
                         fused=fused, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, backend=backend, seed=seed)

    def _check_group_rules(self, group, where: str) -> None:
        if not group["momentum"] > 0:
            raise ValueError(f"{where} momentum={group['momentum']!r}: {type(self).__name__} "
                             f"needs momentum > 0 (the {self._STATE_BITS}-bit state is the "
                             "momentum buffer); use mpfused.SGD")

    def _flags_8bit(self, group) -> dict:
        return dict(nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))

    def _bnb_group(self, gi, group) -> dict:
        for key in ("dampening", "nesterov"):
            if group[key]:
                raise ValueError(f"to_bitsandbytes_state_dict: param group {gi} has {key}="
                                 f"{group[key]!r}, which bitsandbytes' SGD8bit ignores, so its "
                                 "steps would differ")
        return {"betas": (float(group["momentum"]), 0.0), "eps": 0.0,
                "weight_decay": float(group["weight_decay"])}

