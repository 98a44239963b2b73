"""Multi-tensor Lion step (Chen et al. 2023; decoupled weight decay, maximize) with the master
modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters
included), fused clipping and stochastic-rounding streams of adam_step_. ``exp_avgs``: one fp32
moment per param (csrc/include/mpfused/lion_math.h)."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import fake_kernel, lion_operands
from mpfused.ops.registry import define_op
from mpfused.reference import lion as ref


_op = define_op(
    "lion_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] masters, Tensor(d!)[] steps, *, float lr, Tensor? lr_tensor, float beta1, "
    "float beta2, float weight_decay, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.lion_step_,
    fake=fake_kernel(lion_operands, "lion_step_"),
    triton="mpfused.triton_kernels.lion:lion_step_",
)


@_op.wraps
def lion_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               masters: list[Tensor], steps: list[Tensor], *, lr: float, lr_tensor: Tensor | None,
               beta1: float, beta2: float, weight_decay: float, maximize: bool, master_mode: int,
               grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None, norm_sq: Tensor | None = None, max_grad_norm: float = 0.0,
        seed: int = 0, param_ids: Sequence[int] = (), elem_offsets: Sequence[int] = (),
        backend: str | None = None) -> None:
    """One Lion step of every param in place (``torch.ops.mpfused.lion_step_``).

    Operands: ``exp_avgs`` fp32 moments, one per param; ``masters``, ``steps`` as
    ``adam_step_``. Scalars: ``lr`` (or ``lr_tensor``), ``beta1``, ``beta2``, ``weight_decay``
    (decoupled), ``maximize``, ``master_mode``; the scaler / clipping / stochastic-rounding
    arguments as ``adam_step_``. ``backend``: an explicit implementation, else the
    dispatcher's route."""
    _op(params, grads, exp_avgs, masters, steps, lr=lr, lr_tensor=lr_tensor, beta1=beta1,
        beta2=beta2, weight_decay=weight_decay, maximize=maximize, master_mode=master_mode,
        grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
