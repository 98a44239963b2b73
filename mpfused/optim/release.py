"""The optimizer step inside the backward (gradient release): ``mpfused.step_in_backward(opt)``.

Each parameter is updated as soon as its gradient is complete, by the optimizer's own fused
kernel on small buckets of ready parameters, and its gradient is freed at once: the full-model
gradient buffer never exists. The update is the ordinary step's, element for element (same
kernel, same scalars, same stochastic-rounding streams: they are keyed by the parameter, not by
the bucket), so without clipping the params, masters and state are bit-identical to
``loss.backward(); opt.step()``.

Rules (README, "Gradient release"):

* ``opt.step()`` and ``opt.zero_grad()`` stay valid and change nothing while attached (their
  hooks and LR schedulers still run), except on an optimizer with no state yet given grads by
  hand, as DCP's ``get_state_dict`` does to make the state it loads into: that ``step()`` is
  the ordinary one. ``scaler.step(opt)`` hands the scaler what the backward found;
  ``scaler.update()`` backs off as usual.
* Gradient accumulation: backward passes under ``with release.accumulate():`` keep their grads;
  the next backward outside it steps with the accumulated grads and frees them (exact).
* Non-finite grads: every release bucket (``bucket_bytes`` of params adjacent in backward order;
  under DDP, DDP's bucket) is checked before its update (read-only pass, no host sync); a bucket
  with an inf/NaN is not updated at all (params, masters, state, step counts untouched), the
  other buckets are. All-or-nothing is impossible once earlier buckets have stepped;
  ``release.skipped`` counts the skipped buckets of the last backward (a device tensor).
* Clipping by the global norm cannot be known before the first update: ``max_grad_norm`` is
  refused unless ``clip="previous"``: each release bucket clips with the norm of this step's
  grads released so far (its own included) plus the previous step's norm of the grads not
  released yet (``_release_clip.py``): never less than the grads already seen prove necessary,
  exact for the step's last bucket. Its deviation from exact clipping is measured in
  tests/test_release_training.py; the previous step's per-param sums are in ``release.state_dict()``
  (save it with the optimizer's).
* DDP: ``step_in_backward(opt, ddp=model)`` steps each DDP bucket as soon as its all-reduce is
  done (a DDP communication hook, as torch's optimizer-overlap hooks), bit-identical to the
  ordinary DDP step; DDP keeps its own grad buckets, so the win there is the overlap, not the
  grad memory. FSDP2 (DTensor params) is refused: its local grad is complete only after its
  reduce-scatter. Several ranks without ``ddp=`` are refused (the hooks would fire before the
  all-reduce).
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import torch

from mpfused.ops import amp as amp_ops
from mpfused.optim._release_clip import PreviousNormClip
from mpfused.optim._state_table import epoch as state_epoch, tracked

__all__ = ["GradRelease", "step_in_backward"]

DEFAULT_BUCKET_BYTES = 4 * 2**20  # of grads: a few MiB keeps launches few and the peak small


def step_in_backward(optimizer, *, scaler=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     clip: str | None = None, ddp=None) -> "GradRelease":
    """Attach gradient release to an mpfused optimizer; returns the handle (``.accumulate()``,
    ``.skipped``, ``.remove()``). ``scaler``: the ``mpfused.GradScaler`` the losses are scaled
    with (its scale unscales the grads in the kernel). ``clip="previous"``: clip each bucket
    with this step's norm so far plus the previous step's norm of the grads still to come
    (needed with ``max_grad_norm``; the handle's ``state_dict()`` carries it across a
    checkpoint). ``ddp``: the
    ``DistributedDataParallel`` model the optimizer's params belong to: each DDP bucket steps as
    soon as its all-reduce is done (a DDP communication hook), with the averaged grads."""
    return GradRelease(optimizer, scaler=scaler, bucket_bytes=bucket_bytes, clip=clip, ddp=ddp)


class _Chunk:
    """Params of one group, adjacent in backward order, whose grads add up to ~bucket_bytes."""
    __slots__ = ("group_index", "indices", "ready")

    def __init__(self, group_index: int):
        self.group_index = group_index
        self.indices: list[int] = []
        self.ready: set[int] = set()


class GradRelease:
    def __init__(self, optimizer, *, scaler=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 clip: str | None = None, ddp=None):
        if not getattr(optimizer, "_checks_grads_in_step", False):
            raise TypeError("step_in_backward needs an mpfused optimizer, got "
                            f"{type(optimizer).__name__}")
        if getattr(optimizer, "_grad_release", None) is not None:
            raise RuntimeError("step_in_backward: this optimizer already has gradient release "
                               "attached (call .remove() on the first handle)")
        if clip not in (None, "previous"):
            raise ValueError(f"clip must be None or 'previous', got {clip!r}")
        if optimizer.max_grad_norm and clip is None:
            raise ValueError(
                "step_in_backward: max_grad_norm needs the global grad norm before the first "
                "update, which the backward does not have. Pass clip='previous' to clip each "
                "step with the previous step's global norm, or drop max_grad_norm")
        if scaler is not None and not hasattr(scaler, "_check_for_step"):
            raise TypeError("step_in_backward: scaler must be an mpfused.GradScaler (torch's "
                            "scaler checks grads in scaler.step, after release has freed them)")
        if ddp is not None and not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp must be a DistributedDataParallel model, got {type(ddp)}")
        if (ddp is None and torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1):
            raise NotImplementedError(
                "step_in_backward: with several ranks pass ddp=<the DistributedDataParallel "
                "model> (a param's grad-ready hook fires before DDP's all-reduce); FSDP2 is not "
                "supported")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.optimizer, self.scaler, self.bucket_bytes, self.clip = (optimizer, scaler,
                                                                     bucket_bytes, clip)
        self.skipped: torch.Tensor | None = None
        self._accumulating = self._pending = False
        self._handles = []
        self._chunk_of: dict[int, tuple[_Chunk, int]] = {}  # id(param) -> (chunk, index)
        self._chunks: list[_Chunk] = []
        self._in_backward = False
        self._found: dict[torch.device, torch.Tensor] = {}
        self._clip = PreviousNormClip(optimizer) if clip == "previous" else None
        self._group_base = [0]  # flat position of each group's first param (for the clip)
        for g in optimizer.param_groups:
            self._group_base.append(self._group_base[-1] + len(g["params"]))
        self._clip_ids: dict[tuple, torch.Tensor] = {}  # plan key -> its params' flat positions
        self._epoch = self._state_obj = None
        self._plans: dict[tuple, object] = {}  # (group index, ready indices) -> GroupPlan
        self._slots: dict[int, list] = {}  # group index -> its grad list (see _step_ready)
        self._ddp, self._lock = ddp, threading.Lock()
        if ddp is None:
            self._make_chunks()
        else:
            self._watch_ddp(ddp)
        optimizer._grad_release = self

    # ---- set-up -----------------------------------------------------------------------------
    def _make_chunks(self) -> None:
        for gi, group in enumerate(self.optimizer.param_groups):
            chunk, size = None, 0
            # reverse registration order: roughly the order the backward completes grads (DDP)
            for i in reversed(range(len(group["params"]))):
                p = group["params"][i]
                if not p.requires_grad:
                    continue
                if hasattr(p, "to_local"):
                    raise NotImplementedError(
                        "step_in_backward: DTensor (FSDP2) params are not supported: the local "
                        "grad is complete only after FSDP's reduce-scatter")
                nbytes = p.numel() * p.element_size()
                if chunk is None or (size and size + nbytes > self.bucket_bytes):
                    chunk, size = _Chunk(gi), 0
                    self._chunks.append(chunk)
                chunk.indices.append(i)
                size += nbytes
                self._chunk_of[id(p)] = (chunk, i)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _watch_ddp(self, ddp) -> None:
        self._where = {id(p): (gi, i) for gi, g in enumerate(self.optimizer.param_groups)
                       for i, p in enumerate(g["params"])}
        if any(hasattr(p, "to_local") for p in ddp.parameters()):
            raise NotImplementedError("step_in_backward: DTensor params under DDP")
        ddp.register_comm_hook(None, self._ddp_comm_hook)  # DDP allows one, before training

    def remove(self) -> None:
        """Detach: hooks removed, ``opt.step()`` steps again (under DDP the communication hook
        stays, as DDP cannot drop one: it then only all-reduces)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.optimizer._grad_release = None

    @contextlib.contextmanager
    def accumulate(self):
        """Backward passes inside keep (and accumulate) their grads; the first backward after it
        steps with the accumulated grads. Under DDP it is also ``ddp.no_sync()``."""
        previous, self._accumulating = self._accumulating, True
        self._pending = True  # grads kept for a later backward: opt.step() must not take them
        try:
            with self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext():
                yield self
        finally:
            self._accumulating = previous

    def step_done(self) -> None:
        """Called by ``opt.step()``: the next grad that arrives belongs to a new step."""
        self._in_backward = False
        opt = self.optimizer
        # An optimizer with no state yet, given grads by hand (not by an accumulating backward):
        # torch.distributed.checkpoint's get_state_dict makes the state to load into this way
        # (zero grads, lr 0, then step()); without this step it would silently load no state.
        if (not opt.state and not self._pending
                and any(p.grad is not None for g in opt.param_groups for p in g["params"])):
            opt._grad_release = None
            try:
                opt.step()
            finally:
                opt._grad_release = self

    def state_dict(self) -> dict:
        """What the handle carries from step to step: with clip='previous', the last step's sum of
        squares of each param's grad (float32, the optimizer's flat param order); else nothing.
        Save it with the optimizer's state (DCP: pass the handle itself, it is Stateful) for an
        exact resume."""
        return {} if self._clip is None else self._clip.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self._clip is not None:
            self._clip.load_state_dict(state_dict)

    def found_inf_per_device(self) -> dict:
        """For ``GradScaler.step``: the non-finite flags (0/1) of the last backward."""
        return dict(self._found)

    # ---- in the backward --------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._accumulating:
            return
        if not self._in_backward:
            self._start_backward(p.device)
        chunk, i = self._chunk_of[id(p)]
        chunk.ready.add(i)
        if len(chunk.ready) == len(chunk.indices):
            self._release(chunk)

    def _ddp_comm_hook(self, _state, bucket):
        """DDP's default all-reduce (averaging), then this bucket's update with the averaged grads
        (as torch's optimizer-overlap hooks). Every rank sees the same grads, so every rank
        skips the same buckets."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def step(fut):
            if self.optimizer._grad_release is self and not self._accumulating:
                with self._lock, torch.no_grad():  # gloo may complete buckets on its threads
                    self._ddp_step(bucket.parameters(), bucket.gradients())
            return fut.value()
        return allreduce_hook(None, bucket).then(step)

    def _ddp_step(self, params, grads) -> None:
        if not self._in_backward:
            self._start_backward(params[0].device, queue_end=False)
        by_group: dict[int, list] = defaultdict(list)
        for p, g in zip(params, grads):
            if id(p) in self._where:
                by_group[self._where[id(p)][0]].append((self._where[id(p)][1], g))
        for gi, items in by_group.items():
            items.sort(key=lambda item: item[0])
            self._step_ready(gi, tuple(i for i, _ in items), [g for _, g in items])

    def _start_backward(self, device, queue_end: bool = True) -> None:
        self._in_backward, self._pending = True, False
        self._found = {}
        self.skipped = torch.zeros((), dtype=torch.int32, device=device)
        if self._clip is not None:
            self._clip.start(device)
        if queue_end:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        # chunks with params that got no grad in this backward release what they have
        for chunk in self._chunks:
            if chunk.ready:
                self._release(chunk)
        self._in_backward = False

    @torch.no_grad()
    def _release(self, chunk: _Chunk) -> None:
        params = self.optimizer.param_groups[chunk.group_index]["params"]
        ready = tuple(i for i in sorted(chunk.ready) if params[i].grad is not None)
        chunk.ready = set()
        if ready:  # (a grad set to None by a later hook is not stepped)
            self._step_ready(chunk.group_index, ready, [params[i].grad for i in ready])
            for i in ready:
                params[i].grad = None

    def _step_ready(self, group_index: int, ready: tuple, ready_grads: list) -> None:
        """Check and update the params ``group["params"][i] for i in ready`` with these grads:
        one read-only check pass and one update launch per (device, dtype, state kind)."""
        opt = self.optimizer
        group = opt.param_groups[group_index]
        # The planner indexes a group-length grad list: one per group, kept, in which only this
        # bucket's slots are filled (a new list per bucket would cost O(group) per bucket).
        grads = self._slots.get(group_index)
        if grads is None or len(grads) != len(group["params"]):
            grads = self._slots[group_index] = [None] * len(group["params"])
        for i, g in zip(ready, ready_grads):
            grads[i] = g
        try:
            self._update(group, group_index, ready, grads)
        finally:
            for i in ready:
                grads[i] = None

    def _update(self, group, group_index: int, ready: tuple, grads: list) -> None:
        opt = self.optimizer
        plan = self._plan_for(group_index, ready, grads)
        # One decision for all of them (the release bucket is the unit that is skipped, however
        # the planner splits it by dtype and state kind): the flags combined with MAX.
        checked = []
        for b in plan.buckets:
            gs = b.take(grads)
            dev = b.state["local_params"][0].device
            checked.append((b, gs, dev) + self._check(gs, dev))
        if not checked:
            return
        found = checked[0][3]
        for _, _, _, f, _ in checked[1:]:
            found = torch.maximum(found, f.to(found.device))
        clip_sq = None
        if self._clip is not None:  # one norm for the release bucket, from all its parts
            sq = torch.cat([c[4].to(self.skipped.device) for c in checked])
            clip_sq = self._clip.norm_sq_for(self._ids_of(group_index, ready, plan), sq, found)
        for b, gs, dev, _, _ in checked:
            opt._launch(b, gs, group, opt._hyper(group, dev),
                        dict(grad_scale=self._scale_on(dev), found_inf=found.to(dev),
                             norm_sq=None if clip_sq is None else clip_sq.to(dev),
                             max_grad_norm=float(opt.max_grad_norm or 0.0), seed=opt._seed))
        self._record(found)

    def _ids_of(self, group_index: int, ready: tuple, plan) -> torch.Tensor:
        """Flat positions of the plan's params, in the order its buckets check them."""
        ids = self._clip_ids.get((group_index, ready))
        if ids is None:
            base = self._group_base[group_index]
            ids = self._clip_ids[(group_index, ready)] = torch.tensor(
                [base + i for b in plan.buckets for i in b.indices], device=self.skipped.device)
        return ids

    def _plan_for(self, group_index: int, ready: tuple, grads: list):
        """The kernel plan of these ready params (cached: the same sets come every step), made by
        the optimizer's own planner; remade after a write to the state, as step() does."""
        opt = self.optimizer
        if self._epoch != state_epoch() or opt.state is not self._state_obj:
            opt.state = tracked(opt.state)
            self._plans, self._clip_ids = {}, {}
        plan = self._plans.get((group_index, ready))
        if plan is None:
            self._clip_ids.pop((group_index, ready), None)
            plan = self._plans[(group_index, ready)] = opt._plan(
                group_index, opt.param_groups[group_index], grads, cache=False)
            self._epoch, self._state_obj = state_epoch(), opt.state
        return plan

    def _scale_on(self, device):
        s = self.scaler
        if s is None or not s.is_enabled() or s._scale is None:
            return None
        return s._scale.to(device)

    def _check(self, grads, device):
        """The bucket's non-finite flag (0/1) and, for clip='previous', the sum of squares of each
        unscaled grad: one read-only pass, on the device."""
        found = torch.zeros((), dtype=torch.float32, device=device)
        scale = self._scale_on(device)
        inv = (torch.ones((), dtype=torch.float32, device=device) if scale is None
               else scale.double().reciprocal().float())
        per_grad = (torch.zeros(len(grads), dtype=torch.float32, device=device)
                    if self._clip is not None else None)
        amp_ops.check_grads(grads, found, inv, norm_sq_per_tensor=per_grad,
                            backend=self.optimizer._backend)
        return found, per_grad

    def _record(self, found) -> None:
        prev = self._found.get(found.device)
        self._found[found.device] = found.clone() if prev is None else torch.maximum(prev, found)
        self.skipped += (found > 0).to(torch.int32).to(self.skipped.device)
