"""``mpfused.SGD4bit``: ``mpfused.SGD`` with its momentum buffer in block-wise 4 bits: torchao's
4-bit format of ``AdamW4bit``'s first moment (mpfused/quant4.py: the signed 16-entry map, blocks
of 128 with one fp32 absmax each, two codes per byte, nearest code without a sign rule), about
0.53 B/param of state instead of 4 (fp32) or 1.02 (``SGD8bit``). Neither
bitsandbytes nor torchao has a 4-bit SGD: this is ``SGD8bit`` with ``AdamW4bit``'s state kind
(the engine's ``State8bit`` with ``_STATE_BITS = 4``, mpfused/optim/state8bit.py): a subclass that
sets only the width and its op, ``sgd4bit_step_`` (the 8-bit one-state kernels specialized on
4-bit codes; native on the CPU and
on CUDA, the CUDA kernel checked only by nvcc and the host emulation, never on a GPU; Triton on
CUDA without a CUDA build); the constructor,
group rules and flags are ``SGD8bit``'s (mpfused/optim/sgd8bit.py).

* ``momentum`` must be > 0 (the buffer is the only state): ``momentum=0`` raises
  NotImplementedError in the constructor, a group set to it ValueError.
* ``block_size`` (``None``: the format's, 128 as torchao's 4-bit optimizers); bitsandbytes'
  legacy arguments are refused (TypeError).
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
  ``to_bitsandbytes_state_dict()`` refuses (bitsandbytes has no 4-bit SGD).
"""
from __future__ import annotations

from mpfused.ops import sgd4bit as sgd4bit_ops
from mpfused.optim.sgd8bit import SGD8bit

__all__ = ["SGD4bit"]


class SGD4bit(SGD8bit):
    _STATE_BITS = 4
    _OP_8BIT = sgd4bit_ops.sgd4bit_step_.op
