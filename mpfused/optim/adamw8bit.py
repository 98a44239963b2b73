"""``mpfused.AdamW8bit`` / ``mpfused.Adam8bit``: AdamW / Adam with block-wise 8-bit moments
(about 2.03 B/param of state instead of 8), in the format of bitsandbytes >= 0.44: the engine's
8-bit state (``State8bit``, mpfused/optim/state8bit.py, which describes the encoding, the
min_8bit_size / optim_bits / keep_32bit_state rules and the checkpoint format) on ``AdamW``.

* ``exp_avg`` is stored as codes into bitsandbytes' signed map (saved as ``state1`` /
  ``absmax1``), ``exp_avg_sq`` into its unsigned map (``state2`` / ``absmax2``). A step updates in
  float32 exactly like ``mpfused.AdamW`` (torch's decoupled decay before the update, torch's bias
  correction) and updates the param with the unquantized new moments. bitsandbytes' CUDA kernel
  decays after the update (its CPU and Triton paths, torch and torchao before) and divides per
  element; states stay interchangeable (same maps and block layout).
* Params below ``min_8bit_size`` keep fp32 ``exp_avg`` / ``exp_avg_sq`` and take the
  ``mpfused.AdamW`` kernel.
* ``load_state_dict`` also accepts a ``torch.optim.AdamW``/``Adam`` state_dict (moments are
  quantized) and a bitsandbytes ``AdamW8bit`` one, and rejects ``amsgrad=True`` groups.
  ``to_torch_state_dict()`` returns a state_dict that ``torch.optim.AdamW`` (``Adam`` for
  ``Adam8bit``) loads; ``to_bitsandbytes_state_dict()`` one that ``bitsandbytes.optim.AdamW8bit``
  loads.
* ``amsgrad=True`` raises ValueError, as in bitsandbytes.
"""
from __future__ import annotations

import torch

from mpfused.ops import adam8bit as adam8bit_ops
from mpfused.optim._checkpoint_8bit import BLOCK_SIZES, FORMAT_VERSION
from mpfused.optim._overrides import keep_32bit_state
from mpfused.optim.adamw import AdamW
from mpfused.optim.state8bit import State8bit

__all__ = ["AdamW8bit", "Adam8bit", "keep_32bit_state", "BLOCK_SIZES", "FORMAT_VERSION"]


class AdamW8bit(State8bit, AdamW):
    _QUANT_STATES = (("exp_avg", "signed"), ("exp_avg_sq", "unsigned"))
    _OP_8BIT = adam8bit_ops.adam8bit_step_.op
    _TORCH_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                         "capturable", "differentiable", "fused")

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 block_size: int | None = None, min_8bit_size: int = 4096,
                 master_weights: str = "fp32",
                 max_grad_norm: float | None = None, maximize: bool = False,
                 capturable: bool = False, backend: str | None = None, seed: int = 0,
                 foreach=None, fused=None, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None, **legacy):
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True "
                             "(as bitsandbytes); use mpfused.AdamW")
        self._setup_8bit(block_size, min_8bit_size, legacy)
        super().__init__(params, lr, betas, eps, weight_decay, False, maximize=maximize,
                         capturable=capturable, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, backend=backend, seed=seed,
                         foreach=foreach, fused=fused, differentiable=differentiable,
                         decoupled_weight_decay=decoupled_weight_decay)

    def _check_group_rules(self, group, where: str) -> None:
        if group.get("amsgrad"):
            raise ValueError(f"{where} amsgrad=True is not supported (as bitsandbytes); use "
                             "mpfused.AdamW")

    def _flags_8bit(self, group) -> dict:
        return dict(maximize=bool(group["maximize"]),
                    decoupled=bool(group["decoupled_weight_decay"]))

    def _torch_group(self, g) -> dict:
        return {**super()._torch_group(g), "amsgrad": False,
                "decoupled_weight_decay": bool(g["decoupled_weight_decay"])}

    def _bnb_group(self, gi, group) -> dict:
        if not group["decoupled_weight_decay"] and group["weight_decay"]:
            raise ValueError(
                f"to_bitsandbytes_state_dict: param group {gi} has weight_decay="
                f"{group['weight_decay']} with Adam's L2 decay; bitsandbytes' Adam8bit "
                "decouples weight decay (AdamW), so its steps would differ")
        return {"betas": tuple(float(b) for b in group["betas"]), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]), "alpha": 0.0, "t_alpha": None,
                "t_beta3": None}


class Adam8bit(AdamW8bit):
    """``torch.optim.Adam`` semantics with 8-bit state: L2 weight decay added to the gradient,
    default 0. bitsandbytes' Adam8bit decouples weight decay (acts as AdamW8bit): pass
    ``decoupled_weight_decay=True`` for its behaviour."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
