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
* Group options (lr, betas, weight decay, flags, master_weights, ...) changed between steps take
  effect at the next step, as with ``opt.step()`` (a changed plan option re-plans); one changed
  by a hook inside a backward, from the next backward at the latest (the options are read at
  the backward's first grad).
* Gradient accumulation: backward passes under ``with release.accumulate():`` keep their grads;
  the next backward outside it steps with the accumulated grads and frees them (exact).
* Non-finite grads: every release bucket (``bucket_bytes`` of params adjacent in backward order;
  under DDP, DDP's bucket; under FSDP2, an FSDP param group) is checked before its update
  (read-only pass, no host sync; in the same native call as the bucket's first update launch
  where the native kernels serve, except under FSDP2); a bucket
  with an inf/NaN is not updated at all (params, masters, state, step counts untouched), the
  other buckets are. All-or-nothing is impossible once earlier buckets have stepped;
  ``release.skipped`` counts the skipped buckets of the last backward (a device tensor).
* ``optimizer.add_param_group`` after attaching: the new group is released too (its release
  buckets and hooks are made then; under DDP its params must be the DDP model's).
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
  grad memory.
* FSDP2 (HSDP included): ``step_in_backward(opt, fsdp=model)`` (the fully_shard root): a release
  bucket is one FSDP param group, updated on its local shards as soon as FSDP2 has written its
  reduce-scattered grads (FSDP2 fires the sharded params' post-accumulate-grad hooks there,
  torch >= 2.5); its grads are then freed (one flat reduce-scatter buffer per FSDP group: grad
  memory is freed per group, not per param). The bucket's non-finite flag is MAX-all-reduced
  over the mesh before its update, so every rank skips the same buckets (``_release_fsdp.py``).
  Bit-identical to the ordinary FSDP2 step without non-finite grads. ``accumulate()`` keeps the
  sharded grads (FSDP2 still reduce-scatters each micro-batch; ``set_requires_gradient_sync(
  False)`` instead skips those, and then no hook fires until the synced backward).
  ``clip="previous"`` works there too: each bucket's per-param sums of squares are
  SUM-all-reduced over the shard dims (not HSDP's replicate dim) right after the flag, so every
  rank clips with the global norm estimate. FSDP2 release has never run on a GPU (gloo, CPU).
* CPU, plain release: ``worker_threads`` (default: the CPUs torch's intra-op threads leave
  free) runs the armed bucket updates on a native worker thread beside the backward
  (``csrc/bindings/release_worker.cpp``); the backward's end waits for them and raises their
  error. Inside the backward a released bucket's params may still be changing there.
* Several ranks without ``ddp=`` / ``fsdp=`` are refused (the hooks would fire before the
  gradient reduction). So is compiled autograd, at the backward's first hook (it would trace
  the hooks; a torch.compile'd model's backward leaves them eager and releases as usual).
"""
from __future__ import annotations

import contextlib
import operator
from itertools import repeat

import torch

from mpfused import _extension
from mpfused.optim._release_backward import BackwardLife
from mpfused.optim._release_buckets import _Chunk, _Entry, _state_kind
from mpfused.optim._release_clip import PreviousNormClip
from mpfused.optim._release_ddp import DDPRelease
from mpfused.optim._release_fsdp import FSDPRelease
from mpfused.optim._release_update import BucketUpdate
from mpfused.optim._state_table import _EPOCH, epoch as state_epoch

__all__ = ["GradRelease", "step_in_backward"]


def _native_hook():
    """The extension's ``ReadyHook`` type, or None (not built, or a pure-Python install)."""
    module = _extension.load()
    return getattr(module, "ReadyHook", None) if module is not None else None


DEFAULT_BUCKET_BYTES = 4 * 2**20  # of grads: a few MiB keeps launches few and the peak small


def step_in_backward(optimizer, *, scaler=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     clip: str | None = None, ddp=None, fsdp=None,
                     worker_threads: int | None = None) -> "GradRelease":
    """Attach gradient release to an mpfused optimizer; returns the handle (``.accumulate()``,
    ``.skipped``, ``.remove()``). ``scaler``: the ``mpfused.GradScaler`` the losses are scaled
    with (its scale unscales the grads in the kernel). ``clip="previous"``: clip each bucket
    with this step's norm so far plus the previous step's norm of the grads still to come
    (needed with ``max_grad_norm``; the handle's ``state_dict()`` carries it across a
    checkpoint). ``ddp``: the
    ``DistributedDataParallel`` model the optimizer's params belong to: each DDP bucket steps as
    soon as its all-reduce is done (a DDP communication hook), with the averaged grads.
    ``fsdp``: the fully_shard (FSDP2) root module: each FSDP param group steps on its local
    shards as soon as its reduce-scatter is done (``bucket_bytes`` does not apply).
    ``worker_threads`` (CPU, plain release): the release buckets' updates run on a worker thread
    with this many OpenMP threads while the backward goes on; 0 runs them in the backward's
    thread; None (default): as many as the CPUs that torch's intra-op threads leave free (up to
    ``torch.get_num_threads()``), 0 where none is (``_release_update.worker_threads``)."""
    return GradRelease(optimizer, scaler=scaler, bucket_bytes=bucket_bytes, clip=clip, ddp=ddp,
                       fsdp=fsdp, worker_threads=worker_threads)


class GradRelease(BackwardLife, BucketUpdate, DDPRelease, FSDPRelease):
    def __init__(self, optimizer, *, scaler=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 clip: str | None = None, ddp=None, fsdp=None,
                 worker_threads: int | None = None):
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
        if ddp is not None and fsdp is not None:
            raise ValueError("step_in_backward: pass ddp= or fsdp=, not both")
        if (ddp is None and fsdp is None and torch.distributed.is_available()
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            raise NotImplementedError(
                "step_in_backward: with several ranks pass ddp=<the DistributedDataParallel "
                "model> or fsdp=<the fully_shard root module> (a param's grad-ready hook fires "
                "before the gradient reduction)")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if worker_threads is not None and (isinstance(worker_threads, bool) or not isinstance(
                worker_threads, int) or worker_threads < 0):
            raise ValueError(f"worker_threads must be None or an int >= 0, got "
                             f"{worker_threads!r}")
        self.optimizer, self.scaler, self.bucket_bytes, self.clip = (optimizer, scaler,
                                                                     bucket_bytes, clip)
        self.skipped: torch.Tensor | None = None
        self._accumulating = self._pending = False
        self._handles = []
        self._chunk_of: dict[int, tuple[_Chunk, int]] = {}  # id(param) -> (chunk, index)
        self._chunks: list[_Chunk] = []
        self._in_backward = False
        self._end = None  # weakref to the end callback queued in the backward in progress
        self._number = 0  # of the backwards started (a pending end ends its own only)
        self._found: dict[torch.device, torch.Tensor] = {}  # the backward's flag per device
        self._flags: dict = {}  # device -> _flags_on's tuple, for this backward
        self._scaling: dict = {}  # device -> the launches' scaling keywords without clip, ditto
        self._hypers: dict = {}  # (group index, device) -> the group's _hyper, for this backward
        self._bucket_found: dict[torch.device, torch.Tensor] = {}  # reused by every bucket
        self._armed_flags: dict = {}  # device -> the ReleaseFlags its armed steps read
        self._armed_holds: dict = {}  # device -> the tensors last set in it
        self._ahead: dict = {}  # device -> the next backward's flag tensors (_make_flags_ahead)
        self._ahead_now: dict = {}  # the same, taken by this backward
        self._armed_signature = None  # what the chunks' calls were made from (_prepare_calls)
        self.worker_threads = worker_threads
        self._worker = None  # (threads, ReleaseWorker, address): the CPU armed releases' worker
        self._submit = None  # this backward's worker.submit, or None: releases run in place
        self._worker_in_use = None  # that worker's self._worker tuple, for the native hook
        self._clip = PreviousNormClip(optimizer) if clip == "previous" else None
        self._group_base = [0]  # flat position of each group's first param (for the clip)
        for g in optimizer.param_groups:
            self._group_base.append(self._group_base[-1] + len(g["params"]))
        self._epoch = self._state_obj = None
        self._entries: dict[tuple, _Entry] = {}  # (group index, ready indices) -> its update
        self._ddp, self._fsdp = ddp, fsdp
        if ddp is not None:
            self._watch_ddp(ddp)
        elif fsdp is not None:
            self._watch_fsdp(fsdp)
        else:
            self._make_chunks()
        optimizer._grad_release = self

    # ---- set-up -----------------------------------------------------------------------------
    def _make_chunks(self, groups=None) -> None:
        """Release buckets of the groups ``groups`` (indices; default all) and their hooks."""
        kind = _state_kind(self.optimizer)
        first = len(self._chunks)
        for gi in range(len(self.optimizer.param_groups)) if groups is None else groups:
            group = self.optimizer.param_groups[gi]
            open_: dict = {}  # state kind -> (its open chunk, the chunk's grad bytes)
            # reverse registration order: roughly the order the backward completes grads (DDP)
            for i in reversed(range(len(group["params"]))):
                p = group["params"][i]
                if not p.requires_grad:
                    continue
                if hasattr(p, "to_local"):
                    raise NotImplementedError(
                        "step_in_backward: DTensor params need fsdp=<the fully_shard root "
                        "module> (FSDP2 fires their hooks after its reduce-scatter)")
                nbytes = p.numel() * p.element_size()
                k = kind(group, p)
                chunk, size = open_.get(k, (None, 0))
                if chunk is None or (size and size + nbytes > self.bucket_bytes):
                    chunk, size = _Chunk(gi), 0
                    self._chunks.append(chunk)
                chunk.indices.append(i)
                open_[k] = (chunk, size + nbytes)
                self._chunk_of[id(p)] = (chunk, i)
        for chunk in self._chunks[first:]:  # once complete (a hook holds its chunk's size)
            chunk.order = tuple(sorted(chunk.indices))
            params = self.optimizer.param_groups[chunk.group_index]["params"]
            chunk.params = [params[j] for j in chunk.order]
        self._hook(self._chunks[first:])

    def _hook(self, chunks) -> None:
        """The grad-ready hooks of these chunks' params."""
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_ready_hook(chunk, i))
                          for chunk in chunks for i, p in zip(chunk.order, chunk.params)]

    def add_group(self, group_index: int) -> None:
        """``optimizer.add_param_group`` after attaching (called by it): the new group gets its
        release buckets and hooks (under DDP: its params are looked up in DDP's buckets, so they
        must be the DDP model's), and clip='previous' a zero previous sum for each new param."""
        params = self.optimizer.param_groups[group_index]["params"]
        if self._ddp is not None:
            self._ddp_add_group(group_index, params)
        elif self._fsdp is not None:
            self._fsdp_add_group()
        else:
            self._make_chunks([group_index])
        self._group_base.append(self._group_base[-1] + len(params))
        if self._clip is not None:
            self._clip.grow(len(params))

    def remove(self) -> None:
        """Detach: hooks removed, ``opt.step()`` steps again (under DDP the communication hook
        stays, as DDP cannot drop one: it then only all-reduces)."""
        self._drain()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.optimizer._grad_release = None

    def reattach(self) -> "GradRelease":
        """Attach again after ``remove()``: the same buckets hooked again, their kernel plans
        and armed calls kept (groups added meanwhile get theirs); under DDP the communication
        hook, which stayed, steps again. Not under FSDP2, whose hooks a new
        ``step_in_backward`` makes as easily. Returns the handle."""
        opt = self.optimizer
        if self._fsdp is not None:
            raise RuntimeError("reattach: not under FSDP2; call step_in_backward(opt, fsdp=...) "
                               "again (remove() dropped every hook it made)")
        if self._handles or getattr(opt, "_grad_release", None) is self:
            raise RuntimeError("reattach: this handle is attached")
        if getattr(opt, "_grad_release", None) is not None:
            raise RuntimeError("reattach: this optimizer has gradient release attached (call "
                               ".remove() on that handle first)")
        self._in_backward = self._accumulating = self._pending = False
        for chunk in self._chunks:
            chunk.ready.clear()
        self._hook(self._chunks)
        opt._grad_release = self
        for gi in range(len(self._group_base) - 1, len(opt.param_groups)):  # added meanwhile
            self.add_group(gi)
        return self

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
        """Called by ``opt.step()``: the next grad that arrives belongs to a new step. A
        backward that has not ended ends here (worker drained, partly ready buckets released):
        its end is still pending (see _queue_end), or was lost (it raised, as torch.optim then
        steps what grads there are; or a torch that does not run a post hook added while its
        node runs)."""
        if self._in_backward and self._end is not None:
            self._end_backward()
        self._in_backward = False
        self._make_flags_ahead()
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
    def _grad_ready_hook(self, chunk: _Chunk, i: int):
        """Param ``i``'s post-accumulate-grad hook (its chunk, set and size bound: no lookups):
        the native one where the extension is loaded (``csrc/bindings/release_hook.cpp``: the
        same steps, without running Python between the backward's ops unless it must), else
        this Python one."""
        ready, size = chunk.ready, len(chunk.indices)
        native = _native_hook()
        if native is not None:
            return native(self, chunk, ready, i, _EPOCH, size)

        def on_grad_ready(p: torch.Tensor) -> None:
            if self._accumulating:
                return
            if not self._backward_open():
                self._first_grad(p)
            ready.add(i)
            if len(ready) == size:
                self._release(chunk)
        return on_grad_ready

    def _first_grad(self, p: torch.Tensor) -> None:
        """The first grad of a backward (plain release): it starts, its armed calls are made."""
        self._start_backward(p.device)
        self._prepare_calls(p.device)

    def _release(self, chunk: _Chunk) -> None:
        call = chunk.call
        if (call is not None and len(chunk.ready) == len(chunk.order)
                and call[0] == state_epoch() and call[1] is self.optimizer.state
                and not torch.is_grad_enabled()):
            chunk.ready.clear()
            submit = self._submit
            if submit(call[2]) if submit is not None else call[2].run():  # the armed call
                return  # (_prepare_calls): check, step, grads to None; on the worker, queued
            chunk.ready.update(chunk.order)  # a grad set to None by a later hook: below
        if self._submit is not None:
            self._drain()  # the updates below share the backward's flags with the queued ones
        ready, params = chunk.order, chunk.params  # (all ready: the lists made at attach)
        if len(chunk.ready) != len(ready):
            ready, group_params = tuple(sorted(chunk.ready)), self.optimizer.param_groups[
                chunk.group_index]["params"]
            params = [group_params[i] for i in ready]
        chunk.ready.clear()
        grads = [p.grad for p in params]
        if any(map(operator.is_, grads, repeat(None))):  # set to None by a later hook: not stepped
            keep = [k for k, g in enumerate(grads) if g is not None]
            ready = tuple(ready[k] for k in keep)
            params, grads = [params[k] for k in keep], [grads[k] for k in keep]
        if not ready:
            return
        if not torch.is_grad_enabled():  # (a plain backward's hooks: no context to enter)
            self._update(chunk.group_index, ready, grads)
        else:  # backward(create_graph=True): the update records nothing
            with torch.no_grad():
                self._update(chunk.group_index, ready, grads)
        for p in params:
            p.grad = None
