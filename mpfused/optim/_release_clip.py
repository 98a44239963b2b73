"""Clipping inside the backward (gradient release, ``clip="previous"``): the global grad norm a
release bucket clips with, estimated before the rest of the step's grads exist.

A bucket updates while later buckets' grads are not computed yet, so the step's norm N is not
known. The estimate for a bucket is

    N^2 ~ (sum of squares of this step's grads released so far, the bucket's own included)
        + (sum of squares of the previous step's grads of the params not released yet)

i.e. the part of the norm already seen is exact and only the unseen part is taken from the
previous step. It is never below the part seen, so a bucket is never clipped less than the
step's grads already prove necessary; the step's last bucket clips with the exact norm. The
first step (no previous one) counts the seen part only. A bucket with an inf/NaN is not updated
and counts as zero. The coefficient is the ordinary step's, min(1, max_norm / (norm + 1e-6)), in
the kernel. All of it stays on the device: no host sync.

What carries from step to step is one float32 per param (its previous sum of squares, in the
optimizer's flat param order): ``state_dict()`` holds it, for an exact resume."""
from __future__ import annotations

import torch

from mpfused.ops import amp as amp_ops


def check_sums_of_squares(grads: list, found, inv_scale, backend=None) -> torch.Tensor:
    """``check_grads`` of ``grads`` into ``found``, returning each grad's sum of squares (of
    grad * inv_scale): one float32 per grad, zero for an empty one (check_grads takes empty
    tensors; a list of empty ones only is not checked)."""
    sq = torch.zeros(len(grads), dtype=torch.float32, device=found.device)
    if any(g.numel() for g in grads):
        amp_ops.check_grads(grads, found, inv_scale, norm_sq_per_tensor=sq, backend=backend)
    return sq


class PreviousNormClip:
    def __init__(self, optimizer):
        self._n = sum(len(g["params"]) for g in optimizer.param_groups)
        self._cur: torch.Tensor | None = None   # this step's sums of squares, per param
        self._prev: torch.Tensor | None = None  # the previous step's
        self._seen = self._unseen_prev = None   # this step's norm^2 so far; previous, unseen

    def start(self, device) -> None:
        """A new step's backward begins: this step's sums become the previous ones."""
        cur = self._cur if self._cur is not None else torch.zeros(self._n)
        # (an overflowed, non-finite sum carries nothing over)
        self._prev = torch.where(torch.isfinite(cur), cur, torch.zeros_like(cur)).to(device)
        self._cur = torch.zeros(self._n, dtype=torch.float32, device=device)
        self._seen = torch.zeros((), dtype=torch.float32, device=device)
        self._unseen_prev = self._prev.sum()

    def check_and_estimate(self, grad_lists, ids, found, inv_scale, found_total, skipped,
                           backend=None) -> torch.Tensor:
        """A release bucket's check (one check op per planner bucket, ``grad_lists``, in the
        order of ``ids``: each grad's sum of squares, the non-finite flag ``found``, recorded as
        ``check_and_record`` does) and then the squared norm it clips with."""
        found.zero_()
        sqs = [check_sums_of_squares(grads, found, inv_scale, backend) for grads in grad_lists]
        torch.maximum(found_total, found, out=found_total)
        skipped.add_((found > 0).to(skipped.device))
        return self.norm_sq_for(ids, torch.cat(sqs).to(ids.device), found)

    def norm_sq_for(self, ids: torch.Tensor, per_param_sq: torch.Tensor, found) -> torch.Tensor:
        """The squared norm a release bucket clips with. ``ids``: its params' flat positions;
        ``per_param_sq``: their sums of squares (unscaled grads); ``found``: its non-finite flag."""
        dev = self._cur.device
        sq = torch.where(found.to(dev) > 0, torch.zeros_like(per_param_sq), per_param_sq.to(dev))
        self._cur.index_copy_(0, ids, sq)
        self._seen = self._seen + sq.sum()
        self._unseen_prev = self._unseen_prev - self._prev.index_select(0, ids).sum()
        return self._seen + self._unseen_prev.clamp(min=0)  # (rounding can leave it at -eps)

    def grow(self, n: int) -> None:
        """n params appended (a param group added): their previous sums are zero."""
        self._n += n
        for name in ("_cur", "_prev"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, t.new_zeros(n)]))

    def state_dict(self) -> dict:
        cur = self._cur if self._cur is not None else torch.zeros(self._n)
        return {"clip_sq_per_param": cur.detach().clone()}

    def load_state_dict(self, state_dict: dict) -> None:
        sq = state_dict["clip_sq_per_param"]
        if sq.shape != (self._n,):
            raise ValueError(f"clip_sq_per_param has shape {tuple(sq.shape)}, this optimizer "
                             f"has {self._n} params")
        self._cur = sq.detach().to(torch.float32).clone()
