"""``mpfused.AdamW`` and ``mpfused.Adam``: drop-ins for ``torch.optim.AdamW`` / ``torch.optim.Adam``
that train fp32, fp16 or bf16 parameters with one fused multi-tensor kernel per (device, dtype).

fp16/bf16 parameters keep their fp32 value in ``optimizer.state[p]`` (checkpointed with it):

* ``master_weights="fp32"`` (default): ``state["master"]`` fp32 (4 B/param); the param is the
  master rounded to nearest after every step.
* ``master_weights="remainder"`` (bf16 only): ``state["master_remainder"]`` int16 low half of
  the fp32 master (2 B/param); exact, but the optimizer must be the only writer of the params.
* ``master_weights="none"``: no master; bf16 params use stochastic rounding, fp16 params round
  to nearest.

Moments are fp32 for every param dtype. With a GradScaler (mpfused's or torch's) the kernel reads
``grad_scale`` and ``found_inf`` on device: grads are unscaled in registers (not written back)
and a step with found_inf > 0 changes nothing (params, masters, moments, step counters).
``max_grad_norm=`` fuses gradient clipping into the same kernel.
"""
from __future__ import annotations

import copy

import torch
from torch.optim.optimizer import Optimizer

from mpfused.clip_grad import check_by_device
from mpfused.device_copy import copy_to
from mpfused.distributed import all_reduce_, found_inf_groups, reduce_norm_parts
from mpfused.ops import adam as adam_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._args import check_impl_flags, check_mpfused_args, check_torch_args
from mpfused.optim._buckets import GroupPlan, build_buckets
from mpfused.optim._checkpoint import (PER_ELEMENT_KEYS, _plain_dicts, _restore_fp32_state,
                                      _stash_fp32_state, check_state_shape)
from mpfused.optim._masters import master_from_remainder, restore_fp32_param, split_master
from mpfused.optim._streams import elem_offsets, flat_param_ids
from mpfused.optim._state_table import epoch as state_epoch, tracked

__all__ = ["AdamW", "Adam", "MASTER_MODES"]

MASTER_MODES = {"none": 0, "fp32": 1, "remainder": 2}
_STOCHASTIC = 3


class AdamW(Optimizer):
    _step_supports_amp_scaling = True
    _checks_grads_in_step = True  # mpfused.GradScaler hands it check_grads (see grad_scaler.py)
    _grad_release = None  # mpfused.step_in_backward(opt) attaches one (optim/release.py)
    _decoupled = True

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, capturable: bool = False,
                 master_weights: str = "fp32", max_grad_norm: float | None = None,
                 backend: str | None = None, seed: int = 0, foreach=None, fused=None,
                 differentiable: bool = False, decoupled_weight_decay: bool | None = None):
        betas = check_torch_args(lr, betas, eps, weight_decay, foreach, capturable)
        check_mpfused_args(lr, eps, weight_decay, max_grad_norm)
        if master_weights not in MASTER_MODES:
            raise ValueError(f"master_weights must be one of {sorted(MASTER_MODES)}, got "
                             f"{master_weights!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled
        elif self._decoupled and not decoupled_weight_decay:
            raise ValueError(f"mpfused.{type(self).__name__} always decouples weight decay; use "
                             "mpfused.Adam for L2 weight decay")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, capturable=capturable, master_weights=master_weights,
                        foreach=foreach, fused=fused, differentiable=False,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)
        check_impl_flags(fused, foreach, differentiable)  # after super().__init__, as torch
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
        params = self.param_groups[-1]["params"]
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
            self.param_groups.pop()  # nothing of the rejected group stays
            raise ValueError(f"mpfused.{type(self).__name__}: {error}")

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
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("capturable", False)
            group.setdefault("master_weights", "fp32")
            # as torch: AdamW always decouples (also when an Adam state_dict is loaded into it)
            if self._decoupled:
                group["decoupled_weight_decay"] = True
            else:
                group.setdefault("decoupled_weight_decay", False)
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
                        state.pop("master", None)
                        state.pop("master_remainder", None)
                    if "master" in state:
                        state["master"].copy_(p)
                    if "master_remainder" in state:
                        state["master_remainder"].zero_()  # the master is the bf16 value, exact

    # ---- state ------------------------------------------------------------------------------
    def _master_mode(self, group, p) -> int:
        if p.dtype == torch.float32:
            return MASTER_MODES["none"]
        mode = group["master_weights"]
        if mode == "remainder" and p.dtype != torch.bfloat16:
            raise ValueError(f"master_weights='remainder' needs bfloat16 params, got {p.dtype} "
                             "(fp16 is not the top half of fp32)")
        if mode == "none":
            return _STOCHASTIC if p.dtype == torch.bfloat16 else MASTER_MODES["none"]
        return MASTER_MODES[mode]

    def _init_state(self, group, p) -> None:
        """Step and moments of a param without state; _sync_state_keys adds what the group's
        options need (masters, max_exp_avg_sq)."""
        state = self.state[p]
        if len(state) != 0:
            return
        self._master_mode(group, p)  # an invalid mode for this dtype fails before any state
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

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
            check_state_shape(value, local, f"mpfused.{type(self).__name__}: state[p][{key!r}]")
            if value.is_floating_point() and (value.dtype != torch.float32
                                              or _local(value).device != local.device):
                state[key] = value.to(device=local.device, dtype=torch.float32)

    def _plan(self, index: int, group, grads, cache: bool = True) -> GroupPlan:
        params = group["params"]
        extra = (group["amsgrad"], group["master_weights"])
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
        remainder) or else taken from the param; an fp32 param (``model.float()``) takes its
        master's value; a master the mode no longer uses is dropped (kept, a stale one would
        overwrite the param if the mode came back)."""
        state = self.state[p]
        if mode == MASTER_MODES["fp32"] and "master" not in state:
            rem = state.get("master_remainder")
            state["master"] = (p.detach().float() if rem is None
                               else master_from_remainder(p, rem))
        elif mode == MASTER_MODES["remainder"] and "master_remainder" not in state:
            master = state.get("master")
            state["master_remainder"] = (
                torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
                if master is None else split_master(p, master))
        elif p.dtype == torch.float32:
            restore_fp32_param(p, state)
        if mode != MASTER_MODES["fp32"]:
            state.pop("master", None)
        if mode != MASTER_MODES["remainder"]:
            state.pop("master_remainder", None)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                       memory_format=torch.preserve_format)

    def _fill_bucket(self, group, b) -> None:
        """The kernel operand lists of a bucket, cached until the plan is rebuilt."""
        mode = self._master_mode(group, b.params[0])
        for p in b.params:
            self._sync_state_keys(group, p, mode)
        st = [self.state[p] for p in b.params]
        b.state = {
            "steps": [s["step"] for s in st],
            "exp_avgs": [_local(s["exp_avg"]) for s in st],
            "exp_avg_sqs": [_local(s["exp_avg_sq"]) for s in st],
            "max_exp_avg_sqs": [_local(s["max_exp_avg_sq"]) for s in st] if group["amsgrad"] else [],
            "masters": ([_local(s["master"]) for s in st] if mode == MASTER_MODES["fp32"] else
                        [_local(s["master_remainder"]) for s in st]
                        if mode == MASTER_MODES["remainder"] else []),
            "mode": mode,
            "local_params": [_local(p) for p in b.params],
            # stochastic-rounding keys: flat param ids and shard offsets (optim/_streams.py)
            "param_ids": flat_param_ids(self, group, b.indices),
            "elem_offsets": elem_offsets(b.params),
        }
        s = b.state
        s["step_"] = BoundOp(adam_ops.adam_step_, [
            s["local_params"], s["exp_avgs"], s["exp_avg_sqs"], s["max_exp_avg_sqs"],
            s["masters"], s["steps"]], s["param_ids"], s["elem_offsets"])

    # ---- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        _capture_health_check(self)
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
                             _hyper(group, dev),
                             (_on(grad_scale, dev), _on(found_inf, dev), _on(norm_sq, dev),
                              float(self.max_grad_norm or 0.0), self._seed))
        return loss

    def _launch(self, b, grads, group, hyper, scaling) -> None:
        """One fused kernel call for a bucket: (lr, lr_tensor, betas, eps, weight_decay) in
        `hyper`, (grad_scale, found_inf, norm_sq, max_grad_norm, seed) in `scaling`."""
        b.state["step_"](grads, *hyper, bool(group["amsgrad"]), bool(group["maximize"]),
                         bool(group["decoupled_weight_decay"]), b.state["mode"], *scaling,
                         backend=self._backend)

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


class Adam(AdamW):
    """``torch.optim.Adam`` semantics: L2 weight decay added to the gradient, default 0
    (``decoupled_weight_decay=True``: AdamW's decay, as in torch)."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def _hyper(group, device) -> tuple:
    """(lr, lr_tensor, beta1, beta2, eps, weight_decay) as the ops take them: a tensor lr is read
    on the device by the kernel, a float one passed as a scalar."""
    lr = group["lr"]
    beta1, beta2 = group["betas"]
    tensor_lr = isinstance(lr, torch.Tensor)
    return (0.0 if tensor_lr else float(lr), copy_to(lr, device) if tensor_lr else None,
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))


def _is_own_hook(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("mpfused.")


def _capture_health_check(optimizer):
    check = getattr(optimizer, "_accelerator_graph_capture_health_check", None)
    (check or optimizer._cuda_graph_capture_health_check)()


def _local(t):
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _on(t, device):
    return None if t is None else copy_to(t, device)
