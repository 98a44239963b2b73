"""``mpfused.Lion8bit``: ``mpfused.Lion`` with its moment ``exp_avg`` in bitsandbytes' block-wise
8-bit format (``Lion8bit``'s layout: codes into the signed dynamic map, one fp32 absmax per
``block_size`` elements; about 1.02 B/param of state instead of 4), the engine's 8-bit state
(``State8bit``, mpfused/optim/state8bit.py: min_8bit_size / optim_bits / keep_32bit_state rules,
checkpoint format, FSDP2 / DCP) on ``Lion``.

* The update is ``mpfused.Lion``'s (decoupled weight decay before the update, ``sign(0) = 0``,
  NaN kept), as bitsandbytes' Lion8bit computes it.
* Params below ``min_8bit_size`` keep an fp32 ``exp_avg`` and take ``lion_step_``; 8-bit params
  take ``lion8bit_step_``.
* ``block_size`` (``None``: the format's, 256 as bitsandbytes) and bitsandbytes' legacy
  arguments (accepted, ignored): ``State8bit``'s.
* ``Lion4bit`` (mpfused/optim/lion4bit.py) is this class with the 4-bit state format: the
  constructor and flags here serve both.
* ``state_dict()`` saves an 8-bit moment as ``state1`` / ``absmax1``; ``to_torch_state_dict()``
  gives the fp32 state_dict that ``mpfused.Lion`` loads (torch has no Lion), and ``mpfused.Lion``'s
  state_dict loads (quantized). ``to_bitsandbytes_state_dict()`` gives one that
  ``bitsandbytes.optim.Lion8bit`` loads, and bitsandbytes' Lion8bit state_dict loads.
"""
from __future__ import annotations

from torch import Tensor

from mpfused.ops import lion8bit as lion8bit_ops
from mpfused.optim.lion import Lion
from mpfused.optim.state8bit import State8bit

__all__ = ["Lion8bit"]


class Lion8bit(State8bit, Lion):
    _QUANT_STATES = (("exp_avg", "signed"),)
    _OP_8BIT = lion8bit_ops.lion8bit_step_.op

    def __init__(self, params, lr: float | Tensor = 1e-4, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, *, block_size: int | None = None,
                 min_8bit_size: int = 4096, maximize: bool = False, master_weights: str = "fp32",
                 max_grad_norm: float | None = None, backend: str | None = None, seed: int = 0,
                 foreach=None, fused=None, differentiable: bool = False, **legacy):
        self._setup_8bit(block_size, min_8bit_size, legacy)
        super().__init__(params, lr, betas, weight_decay, maximize=maximize,
                         master_weights=master_weights, max_grad_norm=max_grad_norm,
                         backend=backend, seed=seed, foreach=foreach, fused=fused,
                         differentiable=differentiable)

    def _flags_8bit(self, group) -> dict:
        return dict(maximize=bool(group["maximize"]))

    def _bnb_group(self, gi, group) -> dict:
        return {"betas": tuple(float(b) for b in group["betas"]), "eps": 0.0,
                "weight_decay": float(group["weight_decay"])}
