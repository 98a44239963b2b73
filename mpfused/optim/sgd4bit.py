"""``mpfused.SGD4bit``: ``mpfused.SGD`` with its momentum buffer in block-wise 4 bits: torchao's
4-bit format of ``AdamW4bit``'s first moment (mpfused/quant4.py: the signed 16-entry map, blocks
of 128 with one fp32 absmax each, two codes per byte, nearest code without a sign rule), about
0.53 B/param of state instead of 4 (fp32) or 1.02 (``SGD8bit``). Neither bitsandbytes nor torchao
has a 4-bit SGD: this is ``AdamW4bit``'s state kind (the engine's ``State8bit`` with
``_STATE_BITS = 4``, mpfused/optim/state8bit.py) on ``SGD``, stepping through ``sgd4bit_step_``
(the 8-bit one-state kernels specialized on 4-bit codes; native on the CPU and on CUDA, the CUDA
kernel checked only by nvcc and the host emulation, never on a GPU; Triton on CUDA without a CUDA
build).

* ``momentum`` must be > 0 (the buffer is the only state): ``momentum=0`` raises
  NotImplementedError in the constructor, a group set to it ValueError.
* Everything else is ``torch.optim.SGD``'s, as ``mpfused.SGD``: the first step's buffer is the
  gradient itself, dampening, Nesterov, L2 weight decay, maximize, float or tensor lr; every
  master mode (``master_weights``), fused clipping, the scaler contract, gradient release.
* Params below ``min_8bit_size`` (default 4096, torchao's rule for its 4-bit optimizers) keep an
  fp32 ``momentum_buffer`` and take ``sgd_step_``; the others take ``sgd4bit_step_``.
* State: ``momentum_buffer`` as flat packed uint8 codes (ceil(numel / 2)) with
  ``momentum_buffer_absmax``; saved as ``state1`` / ``absmax1`` with ``"mpfused_8bit": {"bits":
  4, maps}``. An 8-bit checkpoint does not load (nor a 4-bit one into ``SGD8bit``): convert
  through ``to_torch_state_dict()``, which gives one that ``torch.optim.SGD`` loads (fp32
  ``momentum_buffer``); a ``torch.optim.SGD`` state_dict loads (quantized).
"""
from __future__ import annotations

from torch import Tensor

from mpfused.ops import sgd4bit as sgd4bit_ops
from mpfused.optim.sgd import SGD
from mpfused.optim.state8bit import State8bit

__all__ = ["SGD4bit"]


class SGD4bit(State8bit, SGD):
    _QUANT_STATES = (("momentum_buffer", "signed"),)
    _STATE_BITS = 4
    _OP_8BIT = sgd4bit_ops.sgd4bit_step_.op
    _TORCH_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                         "foreach", "differentiable", "fused")

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0, nesterov: bool = False,
                 *, block_size: int = 128, min_8bit_size: int = 4096, maximize: bool = False,
                 foreach=None, differentiable: bool = False, fused=None,
                 master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0):
        if momentum == 0:
            raise NotImplementedError("mpfused.SGD4bit: SGD without momentum is not supported "
                                      "(the 4-bit state is the momentum buffer); use "
                                      "mpfused.SGD")
        self._setup_8bit(block_size, min_8bit_size, {})
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         maximize=maximize, foreach=foreach, differentiable=differentiable,
                         fused=fused, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, backend=backend, seed=seed)

    def _check_group_rules(self, group, where: str) -> None:
        if not group["momentum"] > 0:
            raise ValueError(f"{where} momentum={group['momentum']!r}: SGD4bit needs momentum "
                             "> 0 (the 4-bit state is the momentum buffer); use mpfused.SGD")

    def _flags_8bit(self, group) -> dict:
        return dict(nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))
