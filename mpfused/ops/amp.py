"""Loss-scaling ops: multi-tensor non-finite check (+ unscale, + sum of squares) and the scale
update. found_inf is a 0-dim float32 tensor on the grads' device, set to 1 (never cleared); the
rule everywhere is "skip when found_inf > 0". norm_sq / norm_sq_per_tensor are accumulated into."""
from __future__ import annotations

import torch
from torch import Tensor

from mpfused.operand_checks import check_amp, check_tensor
from mpfused.ops.registry import define_op
from mpfused.reference import amp as ref

_CHECK_ARGS = ("Tensor(b!) found_inf, Tensor inv_scale, *, Tensor(c!)? norm_sq=None, "
               "Tensor(d!)? norm_sq_per_tensor=None) -> ()")


def _check_fake(name: str):
    def fake(grads, found_inf, inv_scale, *, norm_sq=None, norm_sq_per_tensor=None):
        check_amp(name, grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor)
    return fake


def _update_fake(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor,
                 backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
                 consecutive_hysteresis=False):
    dev = scale.device
    for name, t, dtype in (("scale", scale, torch.float32), ("found_inf", found_inf, torch.float32),
                           ("growth_tracker", growth_tracker, torch.int32),
                           ("hysteresis_tracker", hysteresis_tracker, torch.int32)):
        check_tensor("update_scale_", name, t, dev, dtype)


_unscale = define_op(
    f"unscale_grads_(Tensor(a!)[] grads, {_CHECK_ARGS}",
    reference=ref.unscale_grads_,
    fake=_check_fake("unscale_grads_"),
    triton="mpfused.triton_kernels.amp:unscale_grads_",
)

_check = define_op(
    f"check_grads(Tensor[] grads, {_CHECK_ARGS}",
    reference=ref.check_grads,
    fake=_check_fake("check_grads"),
    triton="mpfused.triton_kernels.amp:check_grads",
)

_update = define_op(
    "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
    "Tensor found_inf, *, float growth_factor, float backoff_factor, int growth_interval, "
    "int hysteresis, float min_scale, float max_scale, bool consecutive_hysteresis=False) -> ()",
    reference=ref.update_scale_,
    fake=_update_fake,
    triton="mpfused.triton_kernels.amp:update_scale_",
)


@_unscale.wraps
def unscale_grads_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, *,
                   norm_sq: Tensor | None = None, norm_sq_per_tensor: Tensor | None = None,
                   backend: str | None = None) -> None:
    """Multiply every grad by ``inv_scale`` in place; set ``found_inf`` (0-dim fp32 on the
    grads' device) to 1 when an unscaled value is not finite (never cleared). ``norm_sq`` /
    ``norm_sq_per_tensor`` (fp32; one entry per grad): the unscaled grads' sum of squares, in
    total / per tensor, added to them. ``backend``: an explicit implementation, else the
    dispatcher's route."""
    _unscale(grads, found_inf, inv_scale, norm_sq=norm_sq, norm_sq_per_tensor=norm_sq_per_tensor,
             backend=backend)


@_check.wraps
def check_grads(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, *,
                norm_sq: Tensor | None = None, norm_sq_per_tensor: Tensor | None = None,
                backend: str | None = None) -> None:
    """``unscale_grads_`` without writing the grads: the non-finite check (``found_inf``) and
    the sums of squares of the grads times ``inv_scale``, read only. ``backend``: an explicit
    implementation, else the dispatcher's route."""
    _check(grads, found_inf, inv_scale, norm_sq=norm_sq, norm_sq_per_tensor=norm_sq_per_tensor,
           backend=backend)


@_update.wraps
def update_scale_(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                  found_inf: Tensor, *, growth_factor: float, backoff_factor: float,
                  growth_interval: int, hysteresis: int, min_scale: float, max_scale: float,
                  consecutive_hysteresis: bool = False, backend: str | None = None) -> None:
    """The loss-scale update in place: ``scale`` (0-dim fp32) backs off by ``backoff_factor``
    when ``found_inf`` > 0 and ``hysteresis`` non-finite steps were seen
    (``hysteresis_tracker``, int32; ``consecutive_hysteresis``: only consecutive ones count),
    and grows by ``growth_factor`` after ``growth_interval`` finite steps (``growth_tracker``,
    int32), within [``min_scale`` (0: off), ``max_scale`` (inf: off)]. ``backend``: an explicit
    implementation, else the dispatcher's route."""
    _update(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
            hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
            consecutive_hysteresis=consecutive_hysteresis, backend=backend)
