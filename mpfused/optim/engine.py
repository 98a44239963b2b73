"""The engine every fused mpfused optimizer plugs into: ``FusedOptimizer``.

A subclass says what is particular to its algorithm: its constructor and defaults, the state of a
new param (``_init_state``: ``_start_state`` gives the dict with its step counter; the default
adds nothing), its state keys in bitsandbytes' order (``_BNB_STATE_KEYS``), the operand
lists and op of a bucket (``_fill_operands``), the scalars of a launch (``_hyper``,
``_launch_args``) and the group options its plans depend on (``_plan_extra``). The engine gives
every optimizer the rest: master weights of 16-bit params (fp32, int16 remainder, int8 correction, stochastic rounding) and their
conversions, the state table whose writes re-plan the next step, buckets and bound operand lists,
the scaler protocol (``check_grads``, in-kernel unscale and skip-on-inf), fused clipping
(``max_grad_norm``), ``torch.compile``, pickling and the state_dict hooks that keep fp32 state fp32.
"""
from __future__ import annotations

import copy

import torch
from torch.optim.optimizer import Optimizer

from mpfused.clip_grad import check_by_device
from mpfused.device_copy import copy_to
from mpfused.distributed import all_reduce_, found_inf_groups, reduce_norm_parts
from mpfused.master_modes import FP32_MASTER, NO_MASTER, REMAINDER, REMAINDER8, STOCHASTIC
from mpfused.optim._buckets import GroupPlan, build_buckets
from mpfused.optim._checkpoint import (PER_ELEMENT_KEYS, _plain_dicts, _restore_fp32_state,
                                      _stash_fp32_state, check_state_shape)
from mpfused.optim._masters import MASTER_STATE_KEYS, new_master, restore_fp32_param
from mpfused.optim._streams import elem_offsets, flat_param_ids
from mpfused.optim._state_table import epoch as state_epoch, tracked
from mpfused.optim._step_entry import capture_health_check, step_entry

__all__ = ["FusedOptimizer", "MASTER_MODES"]

# master_weights -> the ops' master_mode (mpfused/master_modes.py); "none" on bf16 params is
# stochastic rounding.
MASTER_MODES = {"none": NO_MASTER, "fp32": FP32_MASTER, "remainder": REMAINDER,
                "remainder8": REMAINDER8}


class FusedOptimizer(Optimizer):
    """The base class of mpfused's fused optimizers (not used directly)."""
    _step_supports_amp_scaling = True
    _checks_grads_in_step = True  # mpfused.GradScaler hands it check_grads (see grad_scaler.py)
    _grad_release = None  # mpfused.step_in_backward(opt) attaches one (optim/release.py)
    # Per-element state keys kept as 8-bit codes, with their maps: set by the 8-bit optimizers
    # (optim/state8bit.py); () keeps every state fp32.
    _QUANT_STATES: tuple = ()
    # Its fp32 state keys in bitsandbytes' state1/state2 order: a bitsandbytes 32-bit
    # checkpoint of the same optimizer loads (optim/_checkpoint.py).
    _BNB_STATE_KEYS: tuple = ()
    # Group keys that a state_dict pickled before they existed lacks, with their defaults.
    _GROUP_DEFAULTS: dict = {"maximize": False, "capturable": False, "master_weights": "fp32"}

    @staticmethod
    def _check_master_weights(master_weights) -> None:
        if master_weights not in MASTER_MODES:
            raise ValueError(f"master_weights must be one of {sorted(MASTER_MODES)}, got "
                             f"{master_weights!r}")

    def _adopt_saved_group(self, sg) -> dict:
        """A saved group (ours, torch's or bitsandbytes') with this optimizer's key names."""
        return sg

    def _setup_engine(self, max_grad_norm, backend, seed) -> None:
        """The engine's attributes; a subclass's __init__ calls it after ``Optimizer.__init__``."""
        self.max_grad_norm = max_grad_norm
        self._backend = backend
        self._seed = int(seed)
        self._plans: dict[int, GroupPlan] = {}
        self.state = tracked(self.state)  # writes to it are counted: see _state_table.py
        self._planned_state = (None, -1)  # (self.state, state_epoch()) when the plans were built
        self._register_hooks()

    _one_device_per_group = True  # add_param_group refuses a group that spans devices

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        try:
            self._check_new_group(self.param_groups[-1])
        except ValueError as e:
            self.param_groups.pop()  # nothing of the rejected group stays
            raise ValueError(f"mpfused.{type(self).__name__}: {e}") from None
        if self._grad_release is not None:  # gradient release attached: hooks for its params
            try:
                self._grad_release.add_group(len(self.param_groups) - 1)
            except (ValueError, NotImplementedError):
                self.param_groups.pop()  # refused by release: nothing of it stays
                raise

    def _check_new_group(self, group) -> None:
        """ValueError naming the rule a new group breaks (a subclass adds its own rules and
        defaults: State8bit)."""
        params = group["params"]
        error = None
        if len({id(p) for p in params}) != len(params):
            error = ("a parameter appears twice in one param group; each param must appear once "
                     "(the fused kernel would update it twice)")
        for i, p in enumerate(params):
            if p.is_complex() or not p.is_floating_point() or p.dtype == torch.float64:
                error = f"params must be float32, float16 or bfloat16 real tensors, got {p.dtype}"
            elif p.device != params[0].device:
                error = (f"params of one param group must be on one device: params[{i}] is on "
                         f"{p.device}, params[0] on {params[0].device}")
        if error:
            raise ValueError(error)

    # ---- hooks and pickling ------------------------------------------------------------------
    # Beyond torch's defaults/state/param_groups, a pickled (or deep-copied) optimizer keeps these.
    _PICKLED = {"max_grad_norm": None, "_backend": None, "_seed": 0}

    def _register_hooks(self) -> None:
        """The state_dict hooks that keep fp32 state fp32 on load (torch's load casts it to the
        param dtype)."""
        self.register_load_state_dict_pre_hook(_stash_fp32_state)
        self.register_load_state_dict_post_hook(_restore_fp32_state)
        self.register_state_dict_post_hook(_plain_dicts, prepend=True)

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in self._PICKLED})
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        for key, default in self._PICKLED.items():
            self.__dict__.setdefault(key, copy.copy(default))  # pickled before these were kept
        self._plans = {}
        self.state = tracked(self.state)  # also after torch's load_state_dict (a new defaultdict)
        self._planned_state = (None, -1)
        for group in self.param_groups:
            for key, default in self._GROUP_DEFAULTS.items():
                group.setdefault(key, default)
            self._fix_group(group)
        # torch pickles no hooks: unpickled, the optimizer has none of its own yet
        if _stash_fp32_state not in self._optimizer_load_state_dict_pre_hooks.values():
            self._register_hooks()

    def load_state_dict(self, state_dict) -> None:
        # Our load hooks innermost: the pre-hooks that validate and stash the saved state see the
        # state_dict the user's pre-hooks return; the user's post-hooks see the restored state.
        pre = self._optimizer_load_state_dict_pre_hooks
        for key in [k for k, hook in pre.items() if _is_own_hook(hook)]:
            pre.move_to_end(key)
        post = self._optimizer_load_state_dict_post_hooks
        for key in reversed([k for k, hook in post.items() if _is_own_hook(hook)]):
            post.move_to_end(key, last=False)
        try:
            super().load_state_dict(state_dict)
        finally:  # a failed load leaves no stash behind
            for attr in [a for a in self.__dict__ if a.startswith("_loading")]:
                del self.__dict__[attr]

    def refresh_master_weights(self) -> None:
        """Take the 16-bit params' current values as their masters. The optimizer is the owner of
        a 16-bit param's value: its next step writes the master (rounded) over whatever the param
        holds. Call this after writing params yourself (``model.load_state_dict``, re-initialising
        layers, swapping in EMA weights) so the next step starts from what you wrote."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if not state:
                        continue
                    if p.dtype == torch.float32:  # after model.float(): p is its own master
                        for key in MASTER_STATE_KEYS.values():
                            state.pop(key, None)
                    if "master" in state:
                        state["master"].copy_(p)
                    for key in ("master_remainder", "master_remainder8"):
                        if key in state:
                            state[key].zero_()  # the master is the bf16 value, exact

    def _fix_group(self, group) -> None:
        """A subclass's rule for an unpickled or loaded group (e.g. AdamW always decouples)."""

    # ---- state ------------------------------------------------------------------------------
    def _master_mode(self, group, p) -> int:
        if p.dtype == torch.float32:
            return MASTER_MODES["none"]
        mode = group["master_weights"]
        if mode in ("remainder", "remainder8") and p.dtype != torch.bfloat16:
            raise ValueError(f"master_weights={mode!r} needs bfloat16 params, got {p.dtype} "
                             "(fp16 is not the top half of fp32)")
        if mode == "none":
            return STOCHASTIC if p.dtype == torch.bfloat16 else MASTER_MODES["none"]
        return MASTER_MODES[mode]

    def _adopt_written_state(self, p) -> None:
        """p's state in the form the kernels take, after writes since the plans were made (as
        load_state_dict brings a saved state): ``step`` a 0-d fp32 tensor and floating
        per-element entries fp32, on the param's device (``torch.zeros_like(p)`` of a bf16 param
        is bf16); an entry of another shape is an error that names it."""
        state, local = self.state[p], _local(p)
        step = state.get("step")
        if step is not None and not (isinstance(step, torch.Tensor) and step.dim() == 0
                                     and step.dtype == torch.float32
                                     and step.device == local.device):
            state["step"] = torch.as_tensor(step).to(device=local.device,
                                                     dtype=torch.float32).reshape(())
        for key in PER_ELEMENT_KEYS:
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if value.dtype == torch.uint8 and getattr(self, "_STATE_BITS", 8) == 4:
                continue  # flat packed 4-bit codes (State8bit's form checks)
            check_state_shape(value, local, f"mpfused.{type(self).__name__}: state[p][{key!r}]")
            if value.is_floating_point() and (value.dtype != torch.float32
                                              or _local(value).device != local.device):
                state[key] = value.to(device=local.device, dtype=torch.float32)

    def _plan(self, index: int, group, grads, cache: bool = True) -> GroupPlan:
        params = group["params"]
        extra = self._plan_options(group)
        plan = self._plans.get(index) if cache else None
        if plan is not None and plan.matches(params, grads, extra):
            return plan
        buckets = build_buckets(params, grads)
        for b in buckets:
            for p in b.params:
                self._init_state(group, p)
                self._adopt_written_state(p)
            self._fill_bucket(group, b)
        plan = GroupPlan.of(params, grads, extra, buckets)
        if cache:
            self._plans[index] = plan
        return plan

    def _sync_state_keys(self, group, p, mode: int) -> None:
        """The state keys the bucket's mode needs, after a change since the state was made (the
        param's dtype changed by ``module.to()``, ``master_weights`` or ``amsgrad`` changed): a
        missing master is converted exactly from the other form (fp32 master <-> bf16 param +
        remainder; to an int8 correction it is rounded to 24 bits) or else taken from the param;
        an fp32 param (``model.float()``) takes its master's value; a master the mode no longer
        uses is dropped (kept, a stale one would overwrite the param if the mode came back); then
        the subclass's own keys (``_sync_extra_state``)."""
        state = self.state[p]
        key = MASTER_STATE_KEYS.get(mode)
        if key is not None and key not in state:
            state[key] = new_master(p, state, mode)
        elif key is None and p.dtype == torch.float32:
            restore_fp32_param(p, state)
        for other in MASTER_STATE_KEYS.values():
            if other != key:
                state.pop(other, None)
        self._sync_extra_state(group, p)

    def _fill_bucket(self, group, b) -> None:
        """The kernel operand lists of a bucket, cached until the plan is rebuilt: the engine's
        (steps, masters, mode, local params, stochastic-rounding keys), then the subclass's
        (``_fill_operands``: its state lists and ``b.state["step_"]``, the bound op)."""
        mode = self._master_mode(group, b.params[0])
        for p in b.params:
            self._sync_state_keys(group, p, mode)
        st = [self.state[p] for p in b.params]
        b.state = {
            "steps": [s["step"] for s in st],
            "masters": ([_local(s[MASTER_STATE_KEYS[mode]]) for s in st]
                        if mode in MASTER_STATE_KEYS else []),
            "mode": mode,
            "local_params": [_local(p) for p in b.params],
            # stochastic-rounding keys: flat param ids and shard offsets (optim/_streams.py)
            "param_ids": flat_param_ids(self, group, b.indices),
            "elem_offsets": elem_offsets(b.params),
        }
        self._fill_operands(group, b, st)

    # ---- what a subclass provides -------------------------------------------------------------
    def _plan_extra(self, group) -> tuple:
        """The group options the plans depend on (a change re-plans)."""
        return (group["master_weights"],)

    def _plan_options(self, group) -> tuple:
        """Everything a group's plan depends on besides its params and grads: ``_plan_extra``,
        and what a state-format layer adds (State8bit); gradient release re-plans on it too."""
        return self._plan_extra(group)

    def _sync_extra_state(self, group, p) -> None:
        """State keys the group's options need beyond the masters (e.g. amsgrad's)."""

    # Required of every subclass (AdamW, SGD, Lion define them): the engine has no default.
    def _init_state(self, group, p) -> None:
        """A new param's state (its step counter and per-element state): an optimizer's is
        ``_start_state`` and its per-element state (the default: the step counter only)."""
        self._start_state(group, p)

    def _start_state(self, group, p) -> dict | None:
        """The state of a param without state, with its step counter (a 0-d fp32 zero), after the
        master-mode check (an invalid mode for the dtype fails before any state); None when p
        has state."""
        state = self.state[p]
        if len(state) != 0:
            return None
        self._master_mode(group, p)
        state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
        return state

    def _fill_operands(self, group, b, st) -> None:
        """The bucket's state lists and its bound op, ``b.state["step_"]``."""
        raise NotImplementedError(f"{type(self).__name__} must define _fill_operands")

    def _hyper(self, group, device) -> dict:
        """The group's scalars as the op takes them, by keyword (a tensor lr on ``device``)."""
        raise NotImplementedError(f"{type(self).__name__} must define _hyper")

    def _launch_args(self, b, group, hyper, scaling) -> tuple[tuple, dict]:
        """The arguments of bucket ``b``'s op call after its grads: the operand tensors (passed
        positionally) and the scalars (by keyword). ``hyper`` (``_hyper``) and ``scaling``
        (grad_scale, found_inf, norm_sq, max_grad_norm, seed) are keyword dicts."""
        raise NotImplementedError(f"{type(self).__name__} must define _launch_args")

    def _launch(self, b, grads, group, hyper, scaling) -> None:
        """One op call for bucket ``b`` (its arguments: ``_launch_args``)."""
        operands, scalars = self._launch_args(b, group, hyper, scaling)
        b.state["step_"](grads, *operands, **scalars, backend=self._backend)

    # ---- step -------------------------------------------------------------------------------
    @step_entry
    def step(self, closure=None):
        capture_health_check(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._grad_release is not None:  # the backward stepped (optim/release.py)
            self._grad_release.step_done()
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        norm_sq = getattr(self, "grad_norm_sq", None)
        # The grads as the step pre-hooks left them; mpfused.GradScaler checks these ones.
        all_grads = [[p.grad for p in g["params"]] for g in self.param_groups]
        check_grads = getattr(self, "check_grads", None)
        if check_grads is not None:
            found_inf, norm_sq = check_grads(all_grads)
        # The plans hold the state tensors. torch re-reads the state every step: a write to it
        # since the plans were made (a param's state or entry replaced or deleted, the table
        # cleared or replaced) makes new plans that read it again, and new state where missing.
        if torch.compiler.is_compiling():
            # Traced: no cached plans; dynamo guards on what the trace reads (as for torch's
            # compiled optimizers), and an eager step after compiled ones makes new plans.
            plans = [self._plan(index, group, all_grads[index], cache=False)
                     for index, group in enumerate(self.param_groups)]
            self._planned_state = (None, -1)
        else:
            if (self._planned_state[0] is not self.state
                    or self._planned_state[1] != state_epoch()):
                self.state = tracked(self.state)
                self._plans = {}
            plans = [self._plan(index, group, all_grads[index])
                     for index, group in enumerate(self.param_groups)]
            self._planned_state = (self.state, state_epoch())
        if self.max_grad_norm and norm_sq is None:
            devices = {b.state["local_params"][0].device for plan in plans for b in plan.buckets}
            norm_sq, found_inf = self._own_norm(all_grads, grad_scale, found_inf,
                                                one_device=len(devices) == 1)
        for index, (group, plan) in enumerate(zip(self.param_groups, plans)):
            grads = all_grads[index]
            for b in plan.buckets:
                dev = b.state["local_params"][0].device
                self._launch(b, b.take(grads), group,
                             self._hyper(group, dev),
                             dict(grad_scale=_on(grad_scale, dev), found_inf=_on(found_inf, dev),
                                  norm_sq=_on(norm_sq, dev),
                                  max_grad_norm=float(self.max_grad_norm or 0.0), seed=self._seed))
        return loss

    def _own_norm(self, all_grads, grad_scale, found_inf, one_device: bool = False):
        """Fused clipping without a scaler: one read-only pass for the norm (and non-finites).
        DTensor grads (FSDP2): the local shards' sums of squares are SUM-all-reduced over the
        ranks that shard them (the global norm) and the non-finite flag MAX-all-reduced."""
        grads = [g for gs in all_grads for g in gs if g is not None]
        if not grads:
            return None, found_inf
        dev = _local(grads[0]).device
        norm_sq = torch.zeros((), dtype=torch.float32, device=dev)
        inv = (None if grad_scale is None
               else copy_to(grad_scale, dev).double().reciprocal().float())
        # one check call per device: param groups may live on different GPUs
        parts, own_found, _ = check_by_device(grads, dev, inv, self._backend, one_device)
        all_reduce_(own_found, found_inf_groups(grads), "max")
        reduce_norm_parts(parts, norm_sq)
        if found_inf is not None:
            own_found = torch.maximum(own_found, copy_to(found_inf, dev))
        return norm_sq, own_found



def _is_own_hook(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("mpfused.")


def _local(t):
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _on(t, device):
    return None if t is None else copy_to(t, device)
