"""The life of one backward under gradient release (a mixin of ``release.GradRelease``): its
start at its first grad (what it resets), and its end, an end callback queued in the autograd
engine, which also tells a backward that raised (its callback dropped unrun) and a nested one
(reentrant checkpointing) from the next backward. ``GradRelease`` provides the chunks and FSDP
buckets, ``_clip``, ``_drain``, ``_worker_on``, ``_release``, ``_release_fsdp`` and the
per-backward fields."""
from __future__ import annotations

import sys
import weakref

import torch

# The autograd node this thread is running (None outside one): a nested backward's end callback
# runs inside the node of the enclosing backward that started it.
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _compiled_autograd_on() -> bool:
    ca = sys.modules.get("torch._dynamo.compiled_autograd")  # (not imported: not on)
    return ca is not None and bool(getattr(ca, "in_compiled_autograd_region", False))


class BackwardLife:
    def _backward_open(self) -> bool:
        """Whether the backward this handle last started still runs. A backward that raised
        never runs its end callback: the engine drops it unrun, and so its weakref dies. A nested
        backward (reentrant activation checkpointing runs one inside a node's backward, as a
        graph task of its own) is part of the open one, its end callback alive meanwhile."""
        return self._in_backward and (self._end is None or self._end() is not None)

    def _start_backward(self, device, queue_end: bool = True) -> None:
        if _compiled_autograd_on():  # (before any state changes)
            raise RuntimeError(
                "step_in_backward: not under compiled autograd: it traces the backward's hooks "
                "into a graph, and the release's updates are native calls it cannot trace. "
                "torch.compile the model without compiled autograd, or release.remove() first")
        self._drain()  # (what a failed backward left queued)
        self._number += 1
        self._submit, self._worker_in_use = self._worker_on(device)
        for chunk in self._chunks:  # (params a failed backward marked ready)
            chunk.ready.clear()
        self._in_backward, self._pending = True, False
        self._found, self._flags, self._hypers, self._scaling = {}, {}, {}, {}
        self._ahead_now, self._ahead = self._ahead, {}  # (made at the last opt.step(), if any)
        ahead = self._ahead_now.get(device)
        self.skipped = (ahead[0] if ahead is not None
                        else torch.zeros((), dtype=torch.int32, device=device))
        if self._clip is not None:
            self._clip.start(device)
        self._end = None
        if queue_end:
            self._queue_end()

    def _queue_end(self) -> None:
        """The backward's end, queued in the graph task this thread runs; only the engine holds
        it (see _backward_open). A first grad inside a nested backward (a reentrant checkpoint
        of the model's last layers) queues it in that nested task: there it moves on to the
        enclosing task, through a post hook on the node that ran the nested backward. An end
        still pending at opt.step() (that node belongs to a backward of the user's own: their
        training step ran inside another node's backward) runs there (step_done)."""
        number = self._number

        def end_of_backward():
            if number != self._number or not self._in_backward:
                return  # (ended already, by step_done)
            node = _current_node()
            if node is None:
                self._end_backward()
                return

            def after_node(*_):  # (the node holds it: the backward stays open meanwhile)
                handle.remove()
                if number == self._number and self._in_backward:
                    self._queue_end()
            handle = node.register_hook(after_node)
            self._end = weakref.ref(after_node)
        self._end = weakref.ref(end_of_backward)
        torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)

    def _end_backward(self) -> None:
        try:
            if self._submit is not None:
                self._submit = self._worker_in_use = None
                self._drain()
            # chunks with params that got no grad in this backward release what they have
            for chunk in self._chunks:
                if chunk.ready:
                    self._release(chunk)
            for bucket in self._fsdp_buckets:  # (the same on every rank: FSDP2 reduced them)
                if bucket.ready:
                    self._release_fsdp(bucket)
        finally:  # (a raised error's traceback may keep the callback alive)
            self._in_backward = False
