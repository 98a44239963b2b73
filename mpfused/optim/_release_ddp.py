"""Gradient release under DDP (``step_in_backward(opt, ddp=model)``): each DDP bucket steps in a
DDP communication hook as soon as its all-reduce is done (as torch's optimizer-overlap hooks),
with the averaged grads. A mixin of ``release.GradRelease``: it finds each DDP bucket's params
in the optimizer's groups and hands them to the release's ``_update`` (the same check and
update as a release bucket without DDP)."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch


def _check_reduced(ddp, params, where: str) -> None:
    """Every param that takes a grad must be in DDP's buckets: a param DDP ignores
    (``_set_params_and_buffers_to_ignore_for_model``) or reduces apart
    (``delay_all_reduce_named_params``) never reaches the comm hook, so it would never step."""
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", ddp.parameters())}
    reduced -= {id(p) for p in getattr(ddp, "_delay_all_reduce_params", ())}
    for i, p in enumerate(params):
        if p.requires_grad and id(p) not in reduced:
            raise ValueError(
                f"step_in_backward(ddp=...): {where}['params'][{i}] is not reduced in DDP's "
                "buckets (DDP ignores it, or delays its all-reduce), so it would never be "
                "stepped: leave it out of the optimizer, or out of DDP's ignore / delay lists")


class DDPRelease:
    """The DDP part of ``GradRelease`` (which provides ``optimizer``, ``_accumulating``,
    ``_start_backward`` and ``_update``)."""

    def _watch_ddp(self, ddp) -> None:
        if any(hasattr(p, "to_local") for p in ddp.parameters()):
            raise NotImplementedError("step_in_backward: DTensor params under DDP")
        for gi, g in enumerate(self.optimizer.param_groups):
            _check_reduced(ddp, g["params"], f"param_groups[{gi}]")
        self._lock = threading.Lock()
        self._where = {id(p): (gi, i) for gi, g in enumerate(self.optimizer.param_groups)
                       for i, p in enumerate(g["params"])}
        ddp.register_comm_hook(None, self._ddp_comm_hook)  # DDP allows one, before training

    def _ddp_add_group(self, group_index: int, params: list) -> None:
        """A group added after attaching: its params are looked up in DDP's buckets, so they must
        be the DDP model's."""
        known = {id(p) for p in self._ddp.parameters()}
        if not all(id(p) in known for p in params):
            raise ValueError("step_in_backward(ddp=...): a param group added after "
                             "attaching must hold params of the DistributedDataParallel "
                             "model (its grads are released from DDP's buckets)")
        _check_reduced(self._ddp, params, f"param_groups[{group_index}]")
        self._where.update({id(p): (group_index, i) for i, p in enumerate(params)})

    def _ddp_comm_hook(self, _state, bucket):
        """DDP's default all-reduce (averaging), then this bucket's update with the averaged grads
        (as torch's optimizer-overlap hooks). Every rank sees the same grads, so every rank
        skips the same buckets."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # DDP reduces its buckets strictly in index order: bucket 0 starts a backward (its
        # flags, options, clip sums), here in the backward's thread, before any step of it (the
        # steps may run on the backend's threads). So does each shadow pass of DDP's join hook
        # (a joined rank, outside any backward). No end callback: nothing is left to release.
        if (self.optimizer._grad_release is self and not self._accumulating
                and bucket.index() == 0):
            self._start_backward(bucket.parameters()[0].device, queue_end=False)

        def step(fut):
            if self.optimizer._grad_release is self and not self._accumulating:
                with self._lock, torch.no_grad():  # gloo may complete buckets on its threads
                    self._ddp_step(bucket.parameters(), bucket.gradients())
            return fut.value()
        return allreduce_hook(None, bucket).then(step)

    def _ddp_step(self, params, grads) -> None:
        by_group: dict[int, list] = defaultdict(list)
        for p, g in zip(params, grads):
            if id(p) in self._where:
                by_group[self._where[id(p)][0]].append((self._where[id(p)][1], g))
        for gi, items in by_group.items():
            items.sort(key=lambda item: item[0])
            self._update(gi, tuple(i for i, _ in items), [g for _, g in items])
