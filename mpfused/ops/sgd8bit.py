"""Multi-tensor SGD step with a block-wise 8-bit momentum buffer (bitsandbytes' SGD8bit layout):
momentum_buffers are uint8 codes into qmap (the signed map) with one fp32 absmax per block of
block_size elements. momentum must be > 0 (the buffer is the only state; as bitsandbytes'
SGD8bit). The update is sgd_step_'s (dampening, Nesterov, L2 weight decay, maximize; a tensor
whose step counter is 0 starts its buffer as the gradient), with the same master modes, in-kernel
unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters included), fused
clipping and stochastic-rounding streams. See csrc/include/mpfused/quant8_math.h for the
encoding."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import fake_kernel, one_state_operands
from mpfused.ops.registry import define_op
from mpfused.reference import sgd8bit as ref


# sgd8bit_step_'s arguments, sgd4bit_step_'s too (mpfused/ops/sgd4bit.py)
ARGS = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] absmaxs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor qmap, *, "
        "int block_size, float lr, Tensor? lr_tensor, float momentum, float dampening, "
        "float weight_decay, bool nesterov, bool maximize, int master_mode, "
        "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
        "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()")


_op = define_op(
    "sgd8bit_step_" + ARGS,
    reference=ref.sgd8bit_step_,
    fake=fake_kernel(one_state_operands, "sgd8bit_step_", "momentum_buffers"),
    triton="mpfused.triton_kernels.sgd8bit:sgd8bit_step_",
)


@_op.wraps
def sgd8bit_step_(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
                  absmaxs: list[Tensor], masters: list[Tensor], steps: list[Tensor], qmap: Tensor,
                  *, block_size: int, lr: float, lr_tensor: Tensor | None, momentum: float,
                  dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
                  master_mode: int, grad_scale: Tensor | None = None,
                  found_inf: Tensor | None = None, norm_sq: Tensor | None = None,
                  max_grad_norm: float = 0.0, seed: int = 0, param_ids: Sequence[int] = (),
                  elem_offsets: Sequence[int] = (), backend: str | None = None) -> None:
    """One SGD step with a block-wise 8-bit momentum buffer, in place
    (``torch.ops.mpfused.sgd8bit_step_``).

    Operands: ``momentum_buffers`` uint8 codes (one per param element) into ``qmap`` (the
    signed map, 256 fp32 entries); ``absmaxs`` fp32, one per block of ``block_size`` elements;
    everything else as ``sgd_step_`` (``momentum`` must be > 0). ``backend``: an explicit
    implementation, else the dispatcher's route."""
    _op(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, block_size=block_size,
        lr=lr, lr_tensor=lr_tensor, momentum=momentum, dampening=dampening,
        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, master_mode=master_mode,
        grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
