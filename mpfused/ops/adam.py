"""Multi-tensor Adam/AdamW step with optional fp32 master weights (or bf16 remainders, or
stochastic rounding), in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes,
step counters included) and fused clipping (norm_sq of the unscaled grads + max_grad_norm).

Stochastic rounding (master_mode 3) draws element j of params[i] from the stream of
(seed, step, param_ids[i], elem_offsets[i] + j) (csrc/include/mpfused/adam_math.h::random16):
param_ids should be unique per param and stable (the optimizers pass the param's index in
their flat param order, the ids of torch's state_dict), elem_offsets the position of the
tensor's first element in the whole param (a shard's global offset). Empty lists: each tensor's
position in the call, offset 0."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from mpfused.operand_checks import adam_operands, fake_kernel
from mpfused.ops.registry import define_op
from mpfused.reference import adam as ref


_op = define_op(
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, "
    "Tensor(f!)[] steps, *, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool amsgrad, bool maximize, bool decoupled, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.adam_step_,
    fake=fake_kernel(adam_operands, "adam_step_"),
    triton="mpfused.triton_kernels.adam:adam_step_",
)


@_op.wraps
def adam_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], masters: list[Tensor],
               steps: list[Tensor], *, lr: float, lr_tensor: Tensor | None, beta1: float,
               beta2: float, eps: float, weight_decay: float, amsgrad: bool, maximize: bool,
               decoupled: bool, master_mode: int, grad_scale: Tensor | None = None,
               found_inf: Tensor | None = None, norm_sq: Tensor | None = None,
               max_grad_norm: float = 0.0, seed: int = 0, param_ids: Sequence[int] = (),
               elem_offsets: Sequence[int] = (), backend: str | None = None) -> None:
    """One Adam/AdamW step of every param in place (``torch.ops.mpfused.adam_step_``).

    Operands (one tensor per param; the lists are updated in place): ``exp_avgs``,
    ``exp_avg_sqs`` fp32 moments; ``max_exp_avg_sqs`` fp32 (``amsgrad``; else empty);
    ``masters`` per ``master_mode`` (0 none, 1 fp32 masters, 2 int16 bf16 remainders,
    3 stochastic rounding, 4 int8 remainder8 corrections; empty where the params need none);
    ``steps`` 0-dim fp32 counters, advanced on a taken step.
    Scalars: ``lr`` (or ``lr_tensor``, read on the device when on the params' device),
    ``beta1``, ``beta2``, ``eps``, ``weight_decay`` (``decoupled``: AdamW's, else L2),
    ``amsgrad``, ``maximize``. ``grad_scale``: grads are multiplied by 1/grad_scale;
    ``found_inf`` > 0 skips the step (nothing changes); ``norm_sq`` with ``max_grad_norm`` > 0
    clips by the global norm; ``seed``, ``param_ids``, ``elem_offsets`` key the stochastic
    rounding streams. ``backend``: an explicit implementation (``native``, ``triton``,
    ``reference``), else the dispatcher's route."""
    _op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, lr=lr,
        lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        amsgrad=amsgrad, maximize=maximize, decoupled=decoupled, master_mode=master_mode,
        grad_scale=grad_scale, found_inf=found_inf, norm_sq=norm_sq,
        max_grad_norm=max_grad_norm, seed=seed, param_ids=param_ids, elem_offsets=elem_offsets,
        backend=backend)
