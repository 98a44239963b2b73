"""``mpfused.Lion4bit``: ``mpfused.Lion`` with its moment ``exp_avg`` in block-wise 4 bits:
torchao's 4-bit format of ``AdamW4bit``'s first moment (mpfused/quant4.py: the signed 16-entry
map, blocks of 128 with one fp32 absmax each, two codes per byte, nearest code without a sign
rule), about 0.53 B/param of state instead of 4 (fp32) or 1.02 (``Lion8bit``). Neither
bitsandbytes nor torchao has a 4-bit Lion: this is ``Lion8bit`` with ``AdamW4bit``'s state kind
(the engine's ``State8bit`` with ``_STATE_BITS = 4``, mpfused/optim/state8bit.py): a subclass that
sets only the width and its op, ``lion4bit_step_`` (the 8-bit one-state kernels specialized on
4-bit codes; native on the CPU and
on CUDA, the CUDA kernel checked only by nvcc and the host emulation, never on a GPU; Triton on
CUDA without a CUDA build); the constructor
and flags are ``Lion8bit``'s (mpfused/optim/lion8bit.py).

* ``block_size`` (``None``: the format's, 128 as torchao's 4-bit optimizers); bitsandbytes'
  legacy arguments are refused (TypeError).
* The update is ``mpfused.Lion``'s (decoupled weight decay before the update, ``sign(0) = 0``,
  NaN kept); every master mode (``master_weights``), fused clipping, the scaler contract,
  gradient release.
* Params below ``min_8bit_size`` (default 4096, torchao's rule for its 4-bit optimizers) keep an
  fp32 ``exp_avg`` and take ``lion_step_``; the others take ``lion4bit_step_``.
* State: ``exp_avg`` as flat packed uint8 codes (ceil(numel / 2)) with ``exp_avg_absmax``; saved
  as ``state1`` / ``absmax1`` with ``"mpfused_8bit": {"bits": 4, maps}``. An 8-bit checkpoint
  does not load (nor a 4-bit one into ``Lion8bit``): convert through ``to_torch_state_dict()``,
  the fp32 state_dict that ``mpfused.Lion`` loads (torch has no Lion); ``mpfused.Lion``'s
  state_dict loads (quantized). ``to_bitsandbytes_state_dict()`` refuses (bitsandbytes has no
  4-bit Lion).
"""
from __future__ import annotations

from mpfused.ops import lion4bit as lion4bit_ops
from mpfused.optim.lion8bit import Lion8bit

__all__ = ["Lion4bit"]


class Lion4bit(Lion8bit):
    _STATE_BITS = 4
    _OP_8BIT = lion4bit_ops.lion4bit_step_.op
