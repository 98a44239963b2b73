"""``mpfused.GradScaler``: a drop-in for ``torch.amp.GradScaler`` backed by the fused multi-tensor
check/unscale kernels.

It subclasses the torch class, so the constructor, defaults, methods, errors, per-optimizer state
machine, private surface (``_scale``, ``_growth_tracker``, ``_per_optimizer_states``, ...) and the
5-key ``state_dict`` are torch's own; a checkpoint written by either loads into the other. What
changes:

* grads of all dtypes on a device (fp32/fp16/bf16, any dense layout) are checked and unscaled in
  one fused call (torch's CUDA kernel rejects bf16 and makes one call per dtype);
* with an optimizer that unscales in its own kernel (``_step_supports_amp_scaling``, set by
  mpfused optimizers) ``step`` runs a read-only check pass (torch's writes every grad back) that
  also yields the grad norm when the optimizer asks for fused clipping (``max_grad_norm``);
  no host sync on that path. It sets ``grad_scale`` and ``found_inf`` (torch's protocol) and
  ``grad_norm_sq`` for the optimizer's step. mpfused optimizers (``_checks_grads_in_step``) get
  ``check_grads`` instead of a found_inf: their step calls it with the grads it steps with, once
  its step pre-hooks have run, so a hook that replaces ``p.grad`` decides the update and its grads
  are the ones checked. With any other optimizer ``step`` keeps torch's behaviour, which reads
  found_inf on the host (one sync per step);
* found_inf from several devices or optimizers is combined with MAX, never SUM, so it is 0 or 1;
* ``update`` is one small device op; opt-in extras: ``hysteresis=N`` (Megatron's and
  DeepSpeed's rule: each overflow spends one unit of a budget of N and the scale backs off once
  the budget is spent, then at every overflow until the budget refills, which it does only when
  the scale grows; so N overflows since the last growth back off, consecutive or not),
  ``consecutive_hysteresis=True`` (DeepSpeed's option: every step without overflow refills the
  budget, so only N overflows in a row back off), ``min_scale`` and ``max_scale``;
* with ``process_group=`` (or DTensor grads: FSDP2, over every dim of their mesh) found_inf is
  all-reduced with MAX so every rank skips together; the clipping norm of DTensor grads is
  SUM-reduced over the ranks that shard them (``mpfused.distributed``).
"""
from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from mpfused.device_copy import copy_to
from mpfused.distributed import (all_reduce_, found_inf_groups, is_dtensor, reduce_norm_parts,
                                 shard_groups)
from mpfused.ops import amp as amp_ops

__all__ = ["GradScaler", "OptState"]


class GradScaler(torch.amp.GradScaler):
    _consecutive_hysteresis = False  # scalers pickled before the option existed
    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False, min_scale: float | None = None,
                 max_scale: float | None = None, process_group=None,
                 backend: str | None = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1 (1 = off), got {hysteresis!r}")
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError("consecutive_hysteresis must be a bool, got "
                             f"{consecutive_hysteresis!r}")
        if min_scale is not None and not (min_scale > 0 and math.isfinite(min_scale)):
            raise ValueError(f"min_scale must be a finite number > 0, got {min_scale!r}")
        if max_scale is not None and not max_scale > 0:
            raise ValueError(f"max_scale must be > 0, got {max_scale!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must be <= max_scale ({max_scale})")
        self._hysteresis = hysteresis
        self._consecutive_hysteresis = consecutive_hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None
        self._process_group = process_group
        self._backend = backend

    # ---- lazy state -------------------------------------------------------------------------
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32,
                                              device=dev)

    # ---- the fused check --------------------------------------------------------------------
    def _grads_by_device(self, optimizer, allow_fp16: bool,
                         group_grads: list | None = None) -> tuple[dict, bool]:
        """({device: {shard groups: [local grads]}}, whether any grad is a DTensor): DTensor
        grads (FSDP2) as their local shards, split by the process groups their shards differ over
        (``()`` for plain tensors), so each part's sum of squares can be SUM-reduced over the
        right ranks. group_grads: each group's ``p.grad`` list, when the caller has it."""
        by_device: dict[torch.device, dict] = defaultdict(dict)
        any_dtensor = False
        # mpfused optimizers refuse a group that spans devices, and a grad is on its param's
        # device (torch checks on assignment): reading one device per group is enough.
        one_device = getattr(optimizer, "_one_device_per_group", False)
        if group_grads is None:
            group_grads = _group_grads(optimizer)
        for group, present in zip(optimizer.param_groups, group_grads):
            grads = [g for g in present if g is not None]
            if not grads:
                continue
            # The usual group, checked with built-ins at C speed (a Python loop over 10,000
            # grads costs ~10 ms; reading .device ~0.15 us a tensor): plain dense tensors on
            # one device.
            if set(map(type, grads)) == _PLAIN and set(map(_LAYOUT, grads)) == _STRIDED:
                devices = ({grads[0].device, grads[-1].device} if one_device
                           else set(map(_DEVICE, grads)))
                if len(devices) == 1:
                    if not allow_fp16 and torch.float16 in set(map(_DTYPE, grads)):
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    by_device[devices.pop()].setdefault((), []).extend(grads)
                    continue
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                key = ()
                if grad.is_sparse:
                    # Duplicate indices of a scaled fp16 grad can overflow when summed: check the
                    # coalesced values (as torch does).
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                elif is_dtensor(grad):  # the kernel runs on the local shard
                    any_dtensor = True
                    key = shard_groups(grad)
                    grad = grad.to_local()
                by_device[grad.device].setdefault(key, []).append(grad)
        return by_device, any_dtensor

    def _fused_check(self, optimizer, inv_scale, found_inf, *, write_back: bool,
                     allow_fp16: bool, norm_sq: torch.Tensor | None = None,
                     group_grads: list | None = None):
        """found_inf (MAX-reduced across ranks when distributed) per device, and norm_sq of the
        unscaled grads (the global one: sharded parts SUM-reduced over their shard groups)."""
        per_device: dict[torch.device, torch.Tensor] = {}
        norm_parts: dict[tuple, torch.Tensor] = {}
        op = amp_ops.unscale_grads_ if write_back else amp_ops.check_grads
        with torch.no_grad():
            by_device, any_dtensor = self._grads_by_device(optimizer, allow_fp16, group_grads)
            for device, parts in by_device.items():
                dev_found = torch.zeros((), dtype=torch.float32, device=device)
                dev_inv = copy_to(inv_scale, device)
                for key, grads in parts.items():
                    dev_norm = None
                    if norm_sq is not None:
                        dev_norm = torch.zeros((), dtype=torch.float32, device=device)
                    op(grads, dev_found, dev_inv, norm_sq=dev_norm, backend=self._backend)
                    if dev_norm is not None:
                        dev_norm = copy_to(dev_norm, norm_sq.device)
                        norm_parts[key] = (dev_norm if key not in norm_parts
                                           else norm_parts[key] + dev_norm)
                per_device[device] = dev_found
            self._all_reduce_found_inf(optimizer, per_device, any_dtensor)
            if norm_sq is not None:
                reduce_norm_parts(norm_parts, norm_sq)
        return per_device

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return self._fused_check(optimizer, inv_scale, found_inf, write_back=True,
                                 allow_fp16=allow_fp16)

    def _check_inf_per_device(self, optimizer, group_grads: list | None = None):
        # Read-only: the optimizer unscales in registers; also yields the clipping norm.
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        norm_sq = None
        if getattr(optimizer, "max_grad_norm", None):
            norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device)
        inv_scale = scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._fused_check(
            optimizer, inv_scale, None, write_back=False, allow_fp16=True, norm_sq=norm_sq,
            group_grads=group_grads)
        state["norm_sq"] = norm_sq
        return state["found_inf_per_device"]

    def _all_reduce_found_inf(self, optimizer, per_device, any_dtensor: bool) -> None:
        """MAX over ``process_group`` if given, else over every mesh dim of the DTensor grads."""
        if self._process_group is not None:
            groups = [self._process_group]
            if not per_device:  # no grads here: still join the collective (as ShardedGradScaler)
                per_device[self._scale.device] = torch.zeros((), dtype=torch.float32,
                                                             device=self._scale.device)
        else:
            groups = _dtensor_groups(optimizer) if any_dtensor else []
        if not groups or not per_device:
            return
        found = list(per_device.values())
        # One collective per group whatever the number of devices (ranks must issue the same).
        combined = found[0] if len(found) == 1 else _max_on(found, found[0].device)
        all_reduce_(combined, groups, "max")
        if len(found) > 1:
            for t in found:
                t.copy_(combined)

    # ---- step / update ----------------------------------------------------------------------
    # Under torch.compile the scaler's methods run eagerly, behind graph breaks, as torch's own
    # GradScaler's do (torch.amp is on dynamo's skip list): they keep per-optimizer Python state
    # across calls that a traced frame would only replay at its end.
    @torch._dynamo.disable
    def unscale_(self, optimizer) -> None:
        if getattr(optimizer, "_grad_release", None) is not None:
            raise RuntimeError(
                "unscale_: this optimizer steps inside the backward (mpfused.step_in_backward) "
                "and has freed its grads; clip with max_grad_norm and clip='previous' instead")
        return super().unscale_(optimizer)

    @torch._dynamo.disable
    def step(self, optimizer, *args, **kwargs):
        if not self._enabled or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if "grad_scaler" in _step_params(optimizer):
            return super().step(optimizer, *args, **kwargs)  # legacy protocol: torch's path
        release = getattr(optimizer, "_grad_release", None)
        if release is not None:
            # the backward stepped (mpfused.step_in_backward): hand update() what it found
            state["found_inf_per_device"] = release.found_inf_per_device()
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            return retval
        # mpfused optimizers run the check themselves, on the grads they step with, after their
        # step pre-hooks (a hook may replace p.grad: gradient compression, projections).
        deferred = (state["stage"] is OptState.READY
                    and getattr(optimizer, "_checks_grads_in_step", False))
        if state["stage"] is OptState.READY and not deferred:
            self._check_inf_per_device(optimizer)
        scale = self._get_scale_async()
        optimizer.grad_scale = (None if state["stage"] is OptState.UNSCALED
                                else scale * getattr(optimizer, "grad_scale", 1))
        if deferred:
            optimizer.found_inf = optimizer.grad_norm_sq = None
            optimizer.check_grads = functools.partial(self._check_for_step, optimizer)
        else:
            optimizer.found_inf = self._found_inf_for_step(optimizer, scale)
            optimizer.grad_norm_sq = state.get("norm_sq")
            optimizer.check_grads = None
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del (optimizer.grad_scale, optimizer.found_inf, optimizer.grad_norm_sq,
                 optimizer.check_grads)
        state["stage"] = OptState.STEPPED
        return retval

    def _found_inf_for_step(self, optimizer, scale) -> torch.Tensor:
        state = self._per_optimizer_states[id(optimizer)]
        # No grads at all: torch's fused path steps with found_inf 0 (update() then raises).
        return (_max_on(state["found_inf_per_device"].values(), scale.device)
                if state["found_inf_per_device"] else torch.zeros_like(scale))

    def _check_for_step(self, optimizer, group_grads: list) -> tuple:
        """The check of the grads an optimizer steps with, called by its step once its pre-hooks
        have run (``optimizer.check_grads``): (found_inf, norm_sq) on the scale's device, and
        found_inf recorded for ``update``. group_grads: each group's ``p.grad`` list."""
        self._check_inf_per_device(optimizer, group_grads)
        state = self._per_optimizer_states[id(optimizer)]
        return self._found_inf_for_step(optimizer, self._scale), state["norm_sq"]

    @torch._dynamo.disable
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            return super().update(new_scale)
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [t for s in self._per_optimizer_states.values()
                      for t in s["found_inf_per_device"].values()]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        amp_ops.update_scale_(
            scale, growth_tracker, self._hysteresis_tracker, _max_on(found_infs, scale.device),
            growth_factor=float(self._growth_factor), backoff_factor=float(self._backoff_factor),
            growth_interval=int(self._growth_interval), hysteresis=int(self._hysteresis),
            min_scale=float(self._min_scale or 0.0),
            max_scale=float(self._max_scale if self._max_scale is not None else math.inf),
            consecutive_hysteresis=bool(self._consecutive_hysteresis), backend=self._backend)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # ---- extras in checkpoints (only when used: defaults give torch's exact 5 keys) ---------
    def _extras_used(self) -> bool:
        return (self._hysteresis != 1 or self._consecutive_hysteresis
                or self._min_scale is not None or self._max_scale is not None)

    def state_dict(self):
        sd = super().state_dict()
        if self._enabled and self._extras_used():
            sd.update(hysteresis=self._hysteresis,
                      consecutive_hysteresis=self._consecutive_hysteresis,
                      min_scale=self._min_scale, max_scale=self._max_scale,
                      _hysteresis_tracker=(self._init_hysteresis_tracker
                                           if self._hysteresis_tracker is None
                                           else int(self._hysteresis_tracker.item())))
        return sd

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if "hysteresis" in state_dict:
            self._hysteresis = int(state_dict["hysteresis"])
            # absent from checkpoints written before the option existed: Megatron's rule
            self._consecutive_hysteresis = bool(state_dict.get("consecutive_hysteresis", False))
            self._min_scale = state_dict.get("min_scale")
            self._max_scale = state_dict.get("max_scale")
        tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    def __getstate__(self):
        state = super().__getstate__()
        if self._enabled:
            if self._hysteresis_tracker is not None:
                state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
            state["_hysteresis_tracker"] = None
        return state

    # getters/setters for the extras, in the style of torch's
    def get_hysteresis(self) -> int:
        return self._hysteresis

    def get_consecutive_hysteresis(self) -> bool:
        return self._consecutive_hysteresis

    def get_min_scale(self) -> float | None:
        return self._min_scale

    def get_max_scale(self) -> float | None:
        return self._max_scale


def _group_grads(optimizer) -> list[list]:
    """Each param group's ``p.grad`` list (None where a param has no grad)."""
    return [[p.grad for p in group["params"]] for group in optimizer.param_groups]


_PLAIN = {torch.Tensor}
_STRIDED = {torch.strided}
_LAYOUT, _DEVICE, _DTYPE = (operator.attrgetter(a) for a in ("layout", "device", "dtype"))


def _max_on(tensors, device) -> torch.Tensor:
    """found_inf values combined with MAX on `device` (a SUM could exceed 1: hazard H1)."""
    out = None
    for t in tensors:
        t = copy_to(t, device)
        out = t.clone() if out is None else torch.maximum(out, t)
    return out


def _step_params(optimizer):
    import inspect

    try:
        return inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return {}


def _dtensor_groups(optimizer) -> list:
    """The process groups to MAX-reduce found_inf over when grads are DTensors (FSDP2): every
    dim of every grad mesh (1-D or N-D; reducing over the dims one after another reduces over the
    whole mesh, so every rank of it skips together and keeps the same scale)."""
    return found_inf_groups(p.grad for group in optimizer.param_groups for p in group["params"]
                            if p.grad is not None)
