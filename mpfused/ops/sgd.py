"""Multi-tensor SGD step (torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay,
maximize) with the master modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing
changes, step counters included), fused clipping and stochastic-rounding streams of adam_step_.

``momentum_buffers`` is empty when momentum == 0 and holds one fp32 buffer per param otherwise.
A tensor whose step counter is 0 takes its first step: its buffer becomes the (unscaled, clipped,
decayed) gradient itself, as torch clones it (csrc/include/mpfused/sgd_math.h)."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import fake_kernel, sgd_operands
from mpfused.ops.registry import define_op
from mpfused.reference import sgd as ref


_op = define_op(
    "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] masters, Tensor(d!)[] steps, *, float lr, Tensor? lr_tensor, float momentum, "
    "float dampening, float weight_decay, bool nesterov, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.sgd_step_,
    fake=fake_kernel(sgd_operands, "sgd_step_"),
    triton="mpfused.triton_kernels.sgd:sgd_step_",
)


@_op.wraps
def sgd_step_(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
              masters: list[Tensor], steps: list[Tensor], *, lr: float, lr_tensor: Tensor | None,
              momentum: float, dampening: float, weight_decay: float, nesterov: bool,
              maximize: bool, master_mode: int, grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None, norm_sq: Tensor | None = None, max_grad_norm: float = 0.0,
        seed: int = 0, param_ids: Sequence[int] = (), elem_offsets: Sequence[int] = (),
        backend: str | None = None) -> None:
    """One SGD step of every param in place (``torch.ops.mpfused.sgd_step_``).

    Operands: ``momentum_buffers`` fp32, one per param (empty when ``momentum`` == 0; a tensor
    whose step counter is 0 starts its buffer as the gradient); ``masters``, ``steps`` as
    ``adam_step_``. Scalars: ``lr`` (or ``lr_tensor``), ``momentum``, ``dampening``,
    ``weight_decay`` (L2, into the gradient), ``nesterov``, ``maximize``, ``master_mode``; the
    scaler / clipping / stochastic-rounding arguments as ``adam_step_``. ``backend``: an
    explicit implementation, else the dispatcher's route."""
    _op(params, grads, momentum_buffers, masters, steps, lr=lr, lr_tensor=lr_tensor,
        momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
        maximize=maximize, master_mode=master_mode, grad_scale=grad_scale, found_inf=found_inf,
        norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
