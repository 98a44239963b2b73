"""Multi-tensor Lion step with a block-wise 8-bit moment (bitsandbytes' Lion8bit layout): exp_avgs
are uint8 codes into qmap (the signed map) with one fp32 absmax per block of block_size elements.
The update is lion_step_'s (decoupled weight decay, maximize; NaN is kept, not signed to 0), with
the same master modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes,
step counters included), fused clipping and stochastic-rounding streams. See
csrc/include/mpfused/quant8_math.h for the encoding."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import fake_kernel, one_state_operands
from mpfused.ops.registry import define_op
from mpfused.reference import lion8bit as ref


# lion8bit_step_'s arguments, lion4bit_step_'s too (mpfused/ops/lion4bit.py)
ARGS = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] absmaxs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor qmap, *, "
        "int block_size, float lr, Tensor? lr_tensor, float beta1, float beta2, "
        "float weight_decay, bool maximize, int master_mode, Tensor? grad_scale=None, "
        "Tensor? found_inf=None, Tensor? norm_sq=None, float max_grad_norm=0.0, int seed=0, "
        "int[] param_ids=[], int[] elem_offsets=[]) -> ()")


_op = define_op(
    "lion8bit_step_" + ARGS,
    reference=ref.lion8bit_step_,
    fake=fake_kernel(one_state_operands, "lion8bit_step_", "exp_avgs"),
    triton="mpfused.triton_kernels.lion8bit:lion8bit_step_",
)


@_op.wraps
def lion8bit_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                   absmaxs: list[Tensor], masters: list[Tensor], steps: list[Tensor], qmap: Tensor,
                   *, block_size: int, lr: float, lr_tensor: Tensor | None, beta1: float,
                   beta2: float, weight_decay: float, maximize: bool, master_mode: int,
                   grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
                   norm_sq: Tensor | None = None, max_grad_norm: float = 0.0, seed: int = 0,
                   param_ids: Sequence[int] = (), elem_offsets: Sequence[int] = (),
                   backend: str | None = None) -> None:
    """One Lion step with a block-wise 8-bit moment, in place
    (``torch.ops.mpfused.lion8bit_step_``).

    Operands: ``exp_avgs`` uint8 codes (one per param element) into ``qmap`` (the signed map,
    256 fp32 entries); ``absmaxs`` fp32, one per block of ``block_size`` elements; everything
    else as ``lion_step_``. ``backend``: an explicit implementation, else the dispatcher's
    route."""
    _op(params, grads, exp_avgs, absmaxs, masters, steps, qmap, block_size=block_size, lr=lr,
        lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
        maximize=maximize, master_mode=master_mode, grad_scale=grad_scale, found_inf=found_inf,
        norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
