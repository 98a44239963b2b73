"""Multi-tensor Adam/AdamW step with block-wise 8-bit moments (bitsandbytes layout): exp_avgs and
exp_avg_sqs are uint8 codes into qmap1 (signed) / qmap2 (unsigned) with one fp32 absmax per
block of block_size elements. Same master modes, in-kernel unscale (grad_scale), skip on
found_inf > 0 (nothing changes, step counters included), fused clipping and stochastic-rounding
streams (param_ids, elem_offsets) as adam_step_.
See csrc/include/mpfused/quant8_math.h for the encoding."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import adam8bit_operands, fake_kernel
from mpfused.ops.registry import define_op
from mpfused.reference import adam8bit as ref

# adam8bit_step_'s arguments, adam4bit_step_'s too (mpfused/ops/adam4bit.py)
ARGS = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] absmax1s, Tensor(e!)[] absmax2s, "
        "Tensor(f!)[] masters, Tensor(g!)[] steps, Tensor qmap1, Tensor qmap2, *, int block_size, "
        "float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
        "bool maximize, bool decoupled, int master_mode, Tensor? grad_scale=None, "
        "Tensor? found_inf=None, Tensor? norm_sq=None, float max_grad_norm=0.0, int seed=0, "
        "int[] param_ids=[], int[] elem_offsets=[]) -> ()")


_op = define_op(
    "adam8bit_step_" + ARGS,
    reference=ref.adam8bit_step_,
    fake=fake_kernel(adam8bit_operands, "adam8bit_step_"),
    triton="mpfused.triton_kernels.adam8bit:adam8bit_step_",
)


@_op.wraps
def adam8bit_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                   exp_avg_sqs: list[Tensor], absmax1s: list[Tensor], absmax2s: list[Tensor],
                   masters: list[Tensor], steps: list[Tensor], qmap1: Tensor, qmap2: Tensor, *,
                   block_size: int, lr: float, lr_tensor: Tensor | None, beta1: float,
                   beta2: float, eps: float, weight_decay: float, maximize: bool,
                   decoupled: bool, master_mode: int, grad_scale: Tensor | None = None,
                   found_inf: Tensor | None = None, norm_sq: Tensor | None = None,
                   max_grad_norm: float = 0.0, seed: int = 0, param_ids: Sequence[int] = (),
                   elem_offsets: Sequence[int] = (), backend: str | None = None) -> None:
    """One Adam/AdamW step with block-wise 8-bit moments, in place
    (``torch.ops.mpfused.adam8bit_step_``).

    Operands: ``exp_avgs`` / ``exp_avg_sqs`` uint8 codes (one per param element) into ``qmap1``
    (signed, 256 fp32 entries) / ``qmap2`` (unsigned); ``absmax1s`` / ``absmax2s`` fp32, one
    per block of ``block_size`` elements; ``masters``, ``steps`` and the scalars as
    ``adam_step_`` (no amsgrad). ``backend``: an explicit implementation, else the
    dispatcher's route."""
    _op(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps, qmap1, qmap2,
        block_size=block_size, lr=lr, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, maximize=maximize, decoupled=decoupled,
        master_mode=master_mode, grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
