"""``mpfused.Lion4bit``: ``mpfused.Lion`` with its moment ``exp_avg`` in block-wise 4 bits:
torchao's 4-bit format of ``AdamW4bit``'s first moment (mpfused/quant4.py: the signed 16-entry
map, blocks of 128 with one fp32 absmax each, two codes per byte, nearest code without a sign
rule), about 0.53 B/param of state instead of 4 (fp32) or 1.02 (``Lion8bit``). Neither
bitsandbytes nor torchao has a 4-bit Lion: this is ``AdamW4bit``'s state kind (the engine's
``State8bit`` with ``_STATE_BITS = 4``, mpfused/optim/state8bit.py) on ``Lion``, stepping through
``lion4bit_step_`` (the 8-bit one-state kernels specialized on 4-bit codes; native on the CPU and
on CUDA, the CUDA kernel checked only by nvcc and the host emulation, never on a GPU; Triton on
CUDA without a CUDA build).

* The update is ``mpfused.Lion``'s (decoupled weight decay before the update, ``sign(0) = 0``,
  NaN kept); every master mode (``master_weights``), fused clipping, the scaler contract,
  gradient release.
* Params below ``min_8bit_size`` (default 4096, torchao's rule for its 4-bit optimizers) keep an
  fp32 ``exp_avg`` and take ``lion_step_``; the others take ``lion4bit_step_``.
* State: ``exp_avg`` as flat packed uint8 codes (ceil(numel / 2)) with ``exp_avg_absmax``; saved
  as ``state1`` / ``absmax1`` with ``"mpfused_8bit": {"bits": 4, maps}``. An 8-bit checkpoint
  does not load (nor a 4-bit one into ``Lion8bit``): convert through ``to_torch_state_dict()``,
  the fp32 state_dict that ``mpfused.Lion`` loads (torch has no Lion); ``mpfused.Lion``'s
  state_dict loads (quantized).
"""
from __future__ import annotations

from torch import Tensor

from mpfused.ops import lion4bit as lion4bit_ops
from mpfused.optim.lion import Lion
from mpfused.optim.state8bit import State8bit

__all__ = ["Lion4bit"]


class Lion4bit(State8bit, Lion):
    _QUANT_STATES = (("exp_avg", "signed"),)
    _STATE_BITS = 4
    _OP_8BIT = lion4bit_ops.lion4bit_step_.op

    def __init__(self, params, lr: float | Tensor = 1e-4, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, *, block_size: int = 128, min_8bit_size: int = 4096,
                 maximize: bool = False, master_weights: str = "fp32",
                 max_grad_norm: float | None = None, backend: str | None = None, seed: int = 0,
                 foreach=None, fused=None, differentiable: bool = False):
        self._setup_8bit(block_size, min_8bit_size, {})
        super().__init__(params, lr, betas, weight_decay, maximize=maximize,
                         master_weights=master_weights, max_grad_norm=max_grad_norm,
                         backend=backend, seed=seed, foreach=foreach, fused=fused,
                         differentiable=differentiable)

    def _flags_8bit(self, group) -> dict:
        return dict(maximize=bool(group["maximize"]))
