"""Multi-tensor Adam/AdamW step with block-wise 4-bit moments (torchao's AdamW4bit format, see
mpfused/quant4.py): exp_avgs and exp_avg_sqs are flat uint8 tensors of ceil(numel / 2) bytes, two
codes each, into 16-entry maps qmap1 (signed, +0 inside) / qmap2 (unsigned, zero-free), with one
fp32 absmax per block of block_size elements. No sign rule (nearest code).

A separate op with adam8bit_step_'s schema, not a bits argument: the state's size rule (bytes =
ceil(numel / 2)) and the maps' length are the op's contract, checked per op without a flag that
every call site, fake kernel and bound list would carry; the kernels are the 8-bit ones
specialized on the code width. Same master modes, in-kernel unscale (grad_scale), skip on
found_inf > 0 (nothing changes, step counters included), fused clipping and stochastic-rounding
streams as adam8bit_step_."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.ops.adam8bit import ARGS, fake_for
from mpfused.ops.registry import define_op
from mpfused.reference import adam4bit as ref

_op = define_op(
    "adam4bit_step_" + ARGS,
    reference=ref.adam4bit_step_,
    fake=fake_for("adam4bit_step_"),
    triton="mpfused.triton_kernels.adam8bit:adam4bit_step_",
)


@_op.wraps
def adam4bit_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                   exp_avg_sqs: list[Tensor], absmax1s: list[Tensor], absmax2s: list[Tensor],
                   masters: list[Tensor], steps: list[Tensor], qmap1: Tensor, qmap2: Tensor, *,
                   block_size: int, lr: float, lr_tensor: Tensor | None, beta1: float,
                   beta2: float, eps: float, weight_decay: float, maximize: bool,
                   decoupled: bool, master_mode: int, grad_scale: Tensor | None = None,
                   found_inf: Tensor | None = None, norm_sq: Tensor | None = None,
                   max_grad_norm: float = 0.0, seed: int = 0, param_ids: Sequence[int] = (),
                   elem_offsets: Sequence[int] = (), backend: str | None = None) -> None:
    """One Adam/AdamW step with block-wise 4-bit moments, in place
    (``torch.ops.mpfused.adam4bit_step_``).

    Operands: ``exp_avgs`` / ``exp_avg_sqs`` flat uint8 tensors of ceil(numel / 2) bytes (two
    codes each, element 2k in the high nibble) into ``qmap1`` (signed, 16 fp32 entries) /
    ``qmap2`` (zero-free linear); ``absmax1s`` / ``absmax2s`` fp32, one per block of
    ``block_size`` elements; everything else as ``adam8bit_step_``. ``backend``: an explicit
    implementation, else the dispatcher's route."""
    _op(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps, qmap1, qmap2,
        block_size=block_size, lr=lr, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, maximize=maximize, decoupled=decoupled,
        master_mode=master_mode, grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
