"""Multi-tensor Lion step with a block-wise 4-bit moment (torchao's 4-bit format of AdamW4bit's
first moment, see mpfused/quant4.py): exp_avgs are flat uint8 tensors of ceil(numel / 2) bytes,
two codes each, into qmap (the signed 16-entry map, +0 inside), with one fp32 absmax per block of
block_size elements. Nearest code, no sign rule.

A separate op with lion8bit_step_'s schema, not a bits argument (as adam4bit_step_). Scalars are
keyword-only (operands positional). The kernels are the 8-bit ones specialized on the code
width: the same update (decoupled weight decay, maximize; NaN is kept, not signed to 0), master
modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters
included), fused clipping and stochastic-rounding streams. Native kernels: CPU and CUDA (the CUDA
one only in a CUDA build, checked by nvcc and the host emulation, never on a GPU); without it the
router serves the Triton kernel on CUDA."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.ops.lion8bit import ARGS, fake_for
from mpfused.ops.registry import define_op
from mpfused.reference import lion4bit as ref

_op = define_op(
    "lion4bit_step_" + ARGS,
    reference=ref.lion4bit_step_,
    fake=fake_for("lion4bit_step_"),
    triton="mpfused.triton_kernels.lion8bit:lion4bit_step_",
)


@_op.wraps
def lion4bit_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                   absmaxs: list[Tensor], masters: list[Tensor], steps: list[Tensor], qmap: Tensor,
                   *, block_size: int, lr: float, lr_tensor: Tensor | None, beta1: float,
                   beta2: float, weight_decay: float, maximize: bool, master_mode: int,
                   grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
                   norm_sq: Tensor | None = None, max_grad_norm: float = 0.0, seed: int = 0,
                   param_ids: Sequence[int] = (), elem_offsets: Sequence[int] = (),
                   backend: str | None = None) -> None:
    """One Lion step with a block-wise 4-bit moment, in place
    (``torch.ops.mpfused.lion4bit_step_``).

    Operands: ``exp_avgs`` flat uint8 tensors of ceil(numel / 2) bytes (two codes each, element
    2k in the high nibble) into ``qmap`` (the signed 16-entry map); ``absmaxs`` fp32, one per
    block of ``block_size`` elements; everything else as ``lion8bit_step_``. ``backend``: an
    explicit implementation, else the dispatcher's route."""
    _op(params, grads, exp_avgs, absmaxs, masters, steps, qmap, block_size=block_size, lr=lr,
        lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
        maximize=maximize, master_mode=master_mode, grad_scale=grad_scale, found_inf=found_inf,
        norm_sq=norm_sq, max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids,
        elem_offsets=elem_offsets, backend=backend)
