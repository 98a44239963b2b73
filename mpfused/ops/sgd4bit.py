"""Multi-tensor SGD step with a block-wise 4-bit momentum buffer (torchao's 4-bit format of
AdamW4bit's first moment, see mpfused/quant4.py): momentum_buffers are flat uint8 tensors of
ceil(numel / 2) bytes, two codes each, into qmap (the signed 16-entry map, +0 inside), with one
fp32 absmax per block of block_size elements. Nearest code, no sign rule. momentum must be > 0
(the buffer is the only state).

A separate op with sgd8bit_step_'s schema, not a bits argument (as adam4bit_step_): the state's
size rule and the map's length are the op's contract. Scalars are keyword-only (operands
positional). The kernels are the 8-bit ones specialized on the code width: the same update
(dampening, Nesterov, L2 weight decay, maximize; a tensor whose step counter is 0 starts its
buffer as the gradient), master modes, in-kernel unscale (grad_scale), skip on found_inf > 0
(nothing changes, step counters included), fused clipping and stochastic-rounding streams.
Native kernels: CPU and CUDA (the CUDA one only in a CUDA build, checked by nvcc and the host
emulation, never on a GPU); without it the router serves the Triton kernel on CUDA."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.ops.registry import define_op
from mpfused.ops.sgd8bit import ARGS, fake_for
from mpfused.reference import sgd4bit as ref

_op = define_op(
    "sgd4bit_step_" + ARGS,
    reference=ref.sgd4bit_step_,
    fake=fake_for("sgd4bit_step_"),
    triton="mpfused.triton_kernels.sgd8bit:sgd4bit_step_",
)


@_op.wraps
def sgd4bit_step_(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
                  absmaxs: list[Tensor], masters: list[Tensor], steps: list[Tensor], qmap: Tensor,
                  *, block_size: int, lr: float, lr_tensor: Tensor | None, momentum: float,
                  dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
                  master_mode: int, grad_scale: Tensor | None = None,
                  found_inf: Tensor | None = None, norm_sq: Tensor | None = None,
                  max_grad_norm: float = 0.0, seed: int = 0, param_ids: Sequence[int] = (),
                  elem_offsets: Sequence[int] = (), backend: str | None = None) -> None:
    """One SGD step with a block-wise 4-bit momentum buffer, in place
    (``torch.ops.mpfused.sgd4bit_step_``).

    Operands: ``momentum_buffers`` flat uint8 tensors of ceil(numel / 2) bytes (two codes each,
    element 2k in the high nibble) into ``qmap`` (the signed 16-entry map); ``absmaxs`` fp32,
    one per block of ``block_size`` elements; everything else as ``sgd8bit_step_``.
    ``backend``: an explicit implementation, else the dispatcher's route."""
    _op(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, block_size=block_size,
        lr=lr, lr_tensor=lr_tensor, momentum=momentum, dampening=dampening,
        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, master_mode=master_mode,
        grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
