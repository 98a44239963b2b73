"""Gradient release's update of one release bucket (mpfused/optim/release.py): the bucket's
non-finite check and its fused update launches, the kernel plan per (group, ready params), and
the per-backward flags and scale. A mixin of ``release.GradRelease``, which provides
``optimizer``, ``skipped``, ``_clip``, ``_group_base`` and the per-backward caches."""
from __future__ import annotations

import functools
import math
import operator
import os

import torch

from mpfused.ops.bound import BoundOp, check_and_record
from mpfused.optim._release_buckets import _Entry
from mpfused.optim._state_table import epoch as state_epoch, tracked
from mpfused.optim.engine import FusedOptimizer


def _brought_to(step, armed: tuple, args: tuple) -> bool:
    """Whether the armed ``step``, armed with ``armed``, now holds ``args``: true if they are the
    same objects (the usual case: one C-level pass) or equal (tensors the same objects: the step
    holds them, so an id is not reused; numbers by value, a zero with its sign: 0.0 == -0.0 but
    the steps are not bit-identical; a NaN never equals), after setting the floats that changed
    (an LR scheduler's lr) in the step; false if it must be armed again (it may then hold some
    of the new floats)."""
    if len(armed) != len(args):
        return False
    if all(map(operator.is_, armed, args)):
        return True
    for i, (a, b) in enumerate(zip(armed, args)):
        if a is b:
            continue
        if type(a) is not type(b) or isinstance(a, torch.Tensor):
            return False
        if a == b and (type(a) is not float or a != 0.0
                       or math.copysign(1.0, a) == math.copysign(1.0, b)):
            continue
        if type(b) is not float or not step.set(i, b):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _pure_launch_args(cls) -> bool:
    """The optimizer class's ``_launch_args`` and ``_hyper`` are mpfused's own, which read the
    param group, the planner bucket and the scaling only: the calls made from them stand while
    those are the same (``_calls_signature``). A subclass's own may read more: its calls are
    made again every backward."""
    return all(getattr(getattr(cls, name), "__module__", "").startswith("mpfused.")
               for name in ("_launch_args", "_hyper"))


# Release buckets queued on the worker at most: the grads alive stay a few buckets' (at a full
# queue the backward's thread runs the oldest itself).
WORKER_PENDING = 2


def worker_threads(requested: int | None) -> int:
    """The release worker's thread count: ``requested``, or by default the CPUs this process may
    run on that torch's intra-op threads leave free, at most ``torch.get_num_threads()``. Why
    only free ones: beside a backward that keeps every CPU busy the worker slowed the step
    (2-core VM, 2 intra-op threads: 1.03-1.05x the ordinary step against 1.01-1.02x with the
    updates in the backward's thread); beside one that leaves a CPU free it was as fast or up to
    1% faster (1 intra-op thread; benchmarks/results/release-toggle-worker-*.json). A worker at
    idle priority (SCHED_IDLE) beside the busy backward was tried and left out: with the
    backward's thread running what the worker had not taken it matched the in-place updates
    (1.02-1.03x), without, a worker starved by other processes would hold up the backward."""
    if requested is not None:
        return requested
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity API: macOS, Windows)
        cpus = os.cpu_count() or 1
    threads = torch.get_num_threads()
    return max(0, min(cpus - threads, threads))


class BucketUpdate:
    """The update part of ``GradRelease``: ``_update`` is what every release path (plain, DDP,
    FSDP2) calls with a release bucket's ready params and grads."""

    def _update(self, group_index: int, ready: tuple, ready_grads: list,
                checked: bool = False, norm_sq=None) -> None:
        """Check and update the params ``group["params"][i] for i in ready`` with these grads:
        one decision for all of them (the release bucket is the unit that is skipped, however
        the planner splits it by dtype and state kind), one update launch per planner bucket.
        Without clipping the check is part of the first launch (``BoundOp.check_first``: one
        native call); with clip='previous' its per-grad sums of squares come first. ``checked``:
        the caller has checked and recorded the bucket's flag (FSDP2: all-reduced first);
        ``norm_sq``: then, with clip='previous', the squared norm it clips with (FSDP2: from the
        global per-param sums, one norm for the release bucket across its param groups)."""
        entry = self._entry(group_index, ready, ready_grads)
        if not entry.parts:
            return
        opt = self.optimizer
        group = opt.param_groups[group_index]
        scale, inv, found, total = self._flags_on(entry.device)
        if entry.whole:  # one planner bucket of the grads in ready order (the usual case)
            parts = ((entry.parts[0][0], ready_grads),)
        else:
            parts = [(b, list(pick(ready_grads)[:-1])) for b, pick in entry.parts]
        clip_sq, first = norm_sq, None
        if checked and self._clip is not None and norm_sq is None:
            raise RuntimeError("release: a checked bucket under clip='previous' needs its norm")
        if self._clip is None and not checked:
            first = parts[0][0].state.get("step_")
            if isinstance(first, BoundOp):
                first.check_first(ready_grads, found, inv, total, self.skipped)
            else:  # an optimizer whose buckets do not launch through a BoundOp
                first = None
                check_and_record(ready_grads, found, inv, total, self.skipped,
                                 backend=opt._backend)
        elif not checked:  # one norm for the release bucket, from all its parts' sums of squares
            clip_sq = self._clip.check_and_estimate([gs for _, gs in parts], entry.clip_ids,
                                                    found, inv, total, self.skipped, opt._backend)
        scaling = self._scaling_on(entry.device)
        if clip_sq is not None:  # clip='previous': this bucket's norm estimate
            scaling = dict(scaling, norm_sq=clip_sq)
        try:
            hyper = self._hyper_on(group_index, entry.device)
            for b, gs in parts:
                opt._launch(b, gs, group, hyper, scaling)
        finally:
            if first is not None:
                first._pre = None  # (consumed by the first launch unless it failed before)

    def _prepare_calls(self, device) -> None:
        """At the backward's first grad (plain release): each release bucket's whole update as
        one armed native call, ``chunk.call``: an ``ArmedStep`` (``BoundLists.arm_released_<op>``)
        holding the bucket's params, this backward's flags (``ReleaseFlags``, set once here) and
        exactly the operands and scalars ``_update`` would pass; its ``run()`` takes the grads
        from the params, checks, steps and sets them to None. Made for the buckets that
        ``_update`` would update in one native call (one planner bucket, the kernel plan made at
        an earlier step, native kernels, no clip, on this device); the others (and a bucket
        released in part) take ``_update``. Kept from backward to backward (``chunk.armed``):
        changed floats (an LR scheduler's lr, weight_decay, betas) are set in it, anything else
        that changed arms it again; and where nothing they are made from changed
        (``_calls_signature``: no scheduler, no option set) the calls of the last backward stand
        as they are, with this backward's flags. Why: in the backward, between the autograd
        ops, each layer of Python and each converted argument runs cold; the armed call skips
        them (benchmarks/results/release-armed-calls-cpu2-2026-11-27.txt). The group's options are
        read here, once per backward: an option changed by a hook inside the backward is seen
        from the next backward on (``_update`` reads the scalars at the group's first bucket,
        the flags at each launch; the ordinary step reads all of them after the backward)."""
        signature = self._calls_signature(device)
        last = self._armed_signature
        if (last is not None and signature is not None and last[0] == device
                and len(last) == len(signature)
                and all(map(operator.is_, last[1:], signature[1:]))):
            if any(chunk.call is not None for chunk in self._chunks):
                self._release_flags_on(device)  # this backward's flags into the armed steps
            return  # everything the calls were made from is the same: they stand
        self._armed_signature = None
        for chunk in self._chunks:
            chunk.call = None
        opt = self.optimizer
        if self._clip is not None or type(opt)._launch is not FusedOptimizer._launch:
            return  # (a subclass's own _launch: every launch must go through it)
        if self._epoch != state_epoch() or opt.state is not self._state_obj:
            return  # the plans are remade by the next _entry
        key = (state_epoch(), opt.state)
        options = [opt._plan_options(g) for g in opt.param_groups]
        flags = None
        for chunk in self._chunks:
            entry = self._entries.get((chunk.group_index, chunk.order))
            if (entry is None or not entry.whole or entry.device != device
                    or entry.options != options[chunk.group_index]):
                continue
            b = entry.parts[0][0]
            op = b.state.get("step_")
            arm = op.arm_native(opt._backend) if isinstance(op, BoundOp) else None
            if arm is None:
                continue
            if flags is None:
                flags = self._release_flags_on(device)
            operands, scalars = opt._launch_args(
                b, opt.param_groups[chunk.group_index], self._hyper_on(chunk.group_index, device),
                self._scaling_on(device))
            args = (*operands, *op.ordered(scalars))
            armed = chunk.armed
            if armed is None or armed[0] is not op or not _brought_to(armed[2], armed[1], args):
                step = arm(chunk.params, flags, *args)  # (~13 us hot)
                armed = (op, args, step, step.address())
            chunk.armed = (op, args, *armed[2:])
            chunk.call = (*key, *armed[2:])  # (the address: for the native hook, which runs it)
        if signature is not None and _pure_launch_args(type(opt)):
            self._armed_signature = signature

    def _calls_signature(self, device) -> tuple:
        """What the plain release's armed calls are made from, as objects: the device, the
        state table and plans, the bucket and plan counts, the backend, the clip, the scaler's
        scale, every value and plan option of every param group. If all are the same objects
        as when the calls were made (a backward without an LR scheduler or any change), the
        calls stand as they are (``_prepare_calls``); a float set anew (a scheduler's lr) is not
        the same object, and the calls are then remade or brought to it. None where a group
        holds a tensor (an lr tensor is copied to the device anew each backward)."""
        opt = self.optimizer
        groups = []
        for g in opt.param_groups:
            groups += g.values()
            groups += opt._plan_options(g)
        if any(isinstance(v, torch.Tensor) for v in groups):
            return None
        return (device, state_epoch(), opt.state, self._epoch, self._state_obj,
                len(self._entries), len(self._chunks), opt._backend, self._clip,
                opt.max_grad_norm, opt._seed, torch.compiler.is_compiling(),
                self._scale_on(device), *groups)

    def _worker_on(self, device) -> tuple:
        """(``submit``, ``self._worker``) of the ``ReleaseWorker``
        (csrc/bindings/release_worker.cpp) that runs this backward's armed releases off its
        thread, or (None, None): they run in place. ``self._worker``: (threads, worker, its
        address), which the native hook holds while it submits by address. CPU only (a GPU's
        launches are asynchronous already)."""
        if self.worker_threads == 0 or device.type != "cpu" or torch.compiler.is_compiling():
            return None, None  # (0 first: each call here runs cold, between the backward's ops)
        threads = worker_threads(self.worker_threads)
        worker = self._worker
        if worker is not None and worker[0] != threads:  # (torch.set_num_threads since)
            worker[1].wait()
            worker = self._worker = None
        if threads == 0:
            return None, None
        if worker is None:
            made = torch.classes.mpfused.ReleaseWorker(threads, WORKER_PENDING)
            worker = self._worker = (threads, made, made.address())
        return worker[1].submit, worker

    def _drain(self) -> None:
        """Waits for the releases queued on the worker; raises the first one's error."""
        if self._worker is not None:
            self._worker[1].wait()

    def _release_flags_on(self, device):
        """The ``ReleaseFlags`` the armed steps on a device read, set to this backward's flags
        (one object per device, kept: the armed steps hold it). Not set again when it holds
        them already (made ahead: ``_make_flags_ahead``)."""
        flags = self._armed_flags.get(device)
        if flags is None:
            flags = self._armed_flags[device] = torch.classes.mpfused.ReleaseFlags()
        _, inv, found, total = self._flags_on(device)
        held = (found, inv, total, self.skipped)
        last = self._armed_holds.get(device)
        if last is None or not all(map(operator.is_, last, held)):
            flags.set(*held)  # (a TorchScript-class call: ~65 us cold, between backward ops)
            self._armed_holds[device] = held
        return flags

    def _make_flags_ahead(self) -> None:
        """At ``opt.step()``, outside the backward: the next backward's new flag tensors
        (``skipped``, the inverse scale 1, the backward's found flag) made and set in the armed
        steps' flags now, which the next backward on that device then takes (``_start_backward``,
        ``_flags_on``). Inside the backward, between its ops, the three tensors and the
        ``ReleaseFlags.set`` cost ~100 us cold (benchmarks/results/
        release-8bit-accounting-cpu2-2026-11-28.txt). Where a scale is read (a GradScaler) the
        inverse scale is made from it at the backward's start, as before. CPU only: a GPU's
        tensors made here would be zeroed on the stream current at opt.step(), which need not be
        the backward's (and its host time in the backward hides behind the kernels)."""
        self._ahead = {}
        if torch.compiler.is_compiling():
            return  # (a compiled opt.step(): the TorchScript-class call does not trace)
        for device, flags in self._armed_flags.items():
            found = self._bucket_found.get(device)
            if device.type != "cpu" or found is None or self._scale_on(device) is not None:
                continue
            made = (torch.zeros((), dtype=torch.int32, device=device),
                    torch.ones((), dtype=torch.float32, device=device),
                    torch.zeros((), dtype=torch.float32, device=device))
            held = (found, made[1], made[2], made[0])
            flags.set(*held)
            self._armed_holds[device] = held
            self._ahead[device] = made

    def _hyper_on(self, group_index: int, device) -> dict:
        """The group's ``_hyper`` on a device, once per group and backward (options change
        between steps)."""
        hyper = self._hypers.get((group_index, device))
        if hyper is None:
            opt = self.optimizer
            hyper = self._hypers[(group_index, device)] = opt._hyper(
                opt.param_groups[group_index], device)
        return hyper

    def _scaling_on(self, device) -> dict:
        """The launches' scaling keywords without clip, once per device and backward: the same
        for every bucket."""
        scaling = self._scaling.get(device)
        if scaling is None:
            opt = self.optimizer
            scale, _, found, _ = self._flags_on(device)
            scaling = self._scaling[device] = dict(
                grad_scale=scale, found_inf=found, norm_sq=None,
                max_grad_norm=float(opt.max_grad_norm or 0.0), seed=opt._seed)
        return scaling

    def _entry(self, group_index: int, ready: tuple, ready_grads: list) -> "_Entry":
        """The kernel plan of these ready params and how to feed it (cached: the same sets come
        every step), made by the optimizer's own planner; remade after a write to the state or
        a change of the group's plan options (``_plan_options``: amsgrad, master_weights, ...),
        as step() does."""
        opt = self.optimizer
        if self._epoch != state_epoch() or opt.state is not self._state_obj:
            opt.state = tracked(opt.state)
            self._entries = {}
        entry = self._entries.get((group_index, ready))
        if entry is None or entry.options != opt._plan_options(opt.param_groups[group_index]):
            entry = self._entries[(group_index, ready)] = self._make_entry(group_index, ready,
                                                                           ready_grads)
            self._epoch, self._state_obj = state_epoch(), opt.state
        return entry

    def _make_entry(self, group_index: int, ready: tuple, ready_grads: list) -> "_Entry":
        opt = self.optimizer
        group = opt.param_groups[group_index]
        grads = [None] * len(group["params"])  # the planner indexes a group-length grad list
        for i, g in zip(ready, ready_grads):
            grads[i] = g
        plan = opt._plan(group_index, group, grads, cache=False)
        at = {i: k for k, i in enumerate(ready)}  # group index -> position in ready_grads
        parts = [(b, operator.itemgetter(*(at[i] for i in b.indices), at[b.indices[0]]))
                 for b in plan.buckets]  # (a tuple even for one index; the last one dropped)
        device = plan.buckets[0].state["local_params"][0].device if plan.buckets else None
        clip_ids = None
        if self._clip is not None:  # flat positions of the params, in the order they are checked
            base = self._group_base[group_index]
            clip_ids = torch.tensor([base + i for b in plan.buckets for i in b.indices],
                                    device=self.skipped.device)
        whole = len(plan.buckets) == 1 and tuple(plan.buckets[0].indices) == tuple(ready)
        return _Entry(parts, device, clip_ids, whole, opt._plan_options(group))

    def _flags_on(self, device) -> tuple:
        """(grad_scale, inverse scale, the bucket's found flag, the backward's found flag) on a
        device: the scale and its inverse once per backward; the bucket flag is one tensor reused
        by every bucket (each check clears it), the backward's made once per backward."""
        flags = self._flags.get(device)
        if flags is None:
            scale = self._scale_on(device)
            ahead = self._ahead_now.pop(device, None)  # (_make_flags_ahead: no scale then)
            if scale is None and ahead is not None:
                inv, total = ahead[1], ahead[2]
            else:
                inv = (torch.ones((), dtype=torch.float32, device=device) if scale is None
                       else scale.double().reciprocal().float())
                total = torch.zeros((), dtype=torch.float32, device=device)
            found = self._bucket_found.get(device)
            if found is None:
                found = self._bucket_found[device] = torch.zeros((), dtype=torch.float32,
                                                                 device=device)
            self._found[device] = total
            flags = self._flags[device] = (scale, inv, found, total)
        return flags

    def _scale_on(self, device):
        s = self.scaler
        if s is None or not s.is_enabled() or s._scale is None:
            return None
        return s._scale.to(device)
