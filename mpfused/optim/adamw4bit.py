"""``mpfused.AdamW4bit`` / ``mpfused.Adam4bit``: AdamW / Adam with block-wise 4-bit moments
(Li et al. 2023; torchao's ``AdamW4bit`` format, mpfused/quant4.py): about 1.06 B/param of state
(two 4-bit codes + 2 x 4 / 128 B of absmax per param) instead of 8 (fp32) or 2.03 (8-bit).
The engine's quantized state (``State8bit``, mpfused/optim/state8bit.py: min size, optim_bits,
keep_32bit_state, state conversions, checkpoint format) with ``_STATE_BITS = 4``, on ``AdamW``,
stepping through ``adam4bit_step_`` (the 8-bit kernels specialized on 4-bit codes).

Against ``torchao.optim.AdamW4bit(params, lr, betas, eps, weight_decay, amsgrad, *, block_size,
bf16_stochastic_round)``:

* ``lr``, ``betas``, ``eps``, ``weight_decay`` (default 1e-2; ``Adam4bit``: 0, L2) and
  ``block_size`` (``None``: the format's, 128 as torchao's) mean the same; the update is the
  same fp32 math (decoupled decay before the update, torch's bias correction, the param updated
  with the unquantized moments).
* ``amsgrad=True`` raises (torchao keeps a third 4-bit state; use ``mpfused.AdamW``).
* ``bf16_stochastic_round=True`` is ``master_weights="none"`` (bf16 params updated with
  stochastic rounding, no master). torchao's default (``False``: bf16 params rounded to nearest,
  no master, updates below half a bf16 ulp lost) has no counterpart: ``False`` gives our default
  ``master_weights="fp32"`` (an exact fp32 master; ``"remainder"``: an int16 one).
* Small tensors: torchao keeps fp32 moments for tensors with fewer than 4096 elements **or** a size
  not divisible by block_size; we keep the first rule (``min_8bit_size=4096``, also the 8-bit
  name) and quantize any size (the last block may be short).
* State: ``exp_avg`` / ``exp_avg_sq`` as flat packed uint8 codes (ceil(numel / 2)) with
  ``{key}_absmax``; saved as ``state1`` / ``absmax1`` / ``state2`` / ``absmax2`` with
  ``"mpfused_8bit": {"bits": 4, maps}``. ``to_torchao_state_dict()`` / ``from_torchao_state_dict``
  convert to / from torchao's state (``OptimState4bit`` codes and scales copied byte for byte:
  same maps, nibble order and block layout; mpfused/optim/_torchao_4bit.py; FSDP2: torchao's
  per-shard DTensor state). FSDP2 / DCP: every shard layout (mpfused/distributed_4bit.py).
"""
from __future__ import annotations

import torch

from mpfused.ops import adam4bit as adam4bit_ops
from mpfused.optim._overrides import keep_32bit_state
from mpfused.optim._torchao_4bit import from_torchao_state_dict, to_torchao_state_dict
from mpfused.optim.adamw import AdamW
from mpfused.optim.state8bit import State8bit

__all__ = ["AdamW4bit", "Adam4bit", "keep_32bit_state"]


class AdamW4bit(State8bit, AdamW):
    _QUANT_STATES = (("exp_avg", "signed"), ("exp_avg_sq", "unsigned"))
    _STATE_BITS = 4
    _OP_8BIT = adam4bit_ops.adam4bit_step_.op
    _TORCH_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                         "capturable", "differentiable", "fused")

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 block_size: int | None = None, min_8bit_size: int = 4096,
                 master_weights: str = "fp32",
                 bf16_stochastic_round: bool | None = None,
                 max_grad_norm: float | None = None, maximize: bool = False,
                 capturable: bool = False, backend: str | None = None, seed: int = 0,
                 foreach=None, fused=None, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None):
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True; use "
                             "mpfused.AdamW")
        if bf16_stochastic_round:  # torchao's argument (False: our master_weights applies)
            master_weights = "none"
        self._setup_8bit(block_size, min_8bit_size, {})
        super().__init__(params, lr, betas, eps, weight_decay, False, maximize=maximize,
                         capturable=capturable, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, backend=backend, seed=seed,
                         foreach=foreach, fused=fused, differentiable=differentiable,
                         decoupled_weight_decay=decoupled_weight_decay)

    def _check_group_rules(self, group, where: str) -> None:
        if group.get("amsgrad"):
            raise ValueError(f"{where} amsgrad=True is not supported; use mpfused.AdamW")

    def _flags_8bit(self, group) -> dict:
        return dict(maximize=bool(group["maximize"]),
                    decoupled=bool(group["decoupled_weight_decay"]))

    def _torch_group(self, g) -> dict:
        return {**super()._torch_group(g), "amsgrad": False,
                "decoupled_weight_decay": bool(g["decoupled_weight_decay"])}

    def to_torchao_state_dict(self) -> dict:
        """A state_dict that ``torchao.optim.AdamW4bit`` over the same params loads (see
        mpfused/optim/_torchao_4bit.py)."""
        return to_torchao_state_dict(self)

    def from_torchao_state_dict(self, state_dict: dict) -> None:
        """Load a ``torchao.optim.AdamW4bit`` state_dict (its 4-bit states byte for byte)."""
        from_torchao_state_dict(self, state_dict)


class Adam4bit(AdamW4bit):
    """``torch.optim.Adam`` semantics with 4-bit state: L2 weight decay added to the gradient,
    default 0 (torchao's ``Adam4bit``)."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
