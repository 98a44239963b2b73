"""Exact conversions between the master forms of a param (``optimizer.state[p]``), for a change
of ``master_weights`` or of the param's dtype between steps. An fp32 master and a bf16 param with
its int16 remainder hold the same fp32 value, so each converts to the other without loss (the
split and join of csrc/include/mpfused/adam_math.h, via mpfused.reference.adam)."""
from __future__ import annotations

import torch

from mpfused.reference.adam import remainder_join, remainder_split


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def master_from_remainder(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that bf16 param p and its remainder hold (a DTensor when p is one)."""
    master = p.detach().float()  # p's layout and type; its local values are replaced
    _local(master).copy_(remainder_join(_local(p).detach(), _local(remainder)))
    return master


@torch.no_grad()
def split_master(p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The int16 remainder of fp32 `master`; bf16 param p is set to the master's high half
    rounded to nearest, ties away from zero (round-to-nearest-even, which the fp32-master mode
    wrote, differs on ties), so that join(p, remainder) == master bit for bit."""
    hi, rem = remainder_split(_local(master).contiguous())
    remainder = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
    _local(remainder).copy_(rem)
    _local(p).copy_(hi)
    return remainder


@torch.no_grad()
def restore_fp32_param(p: torch.Tensor, state: dict) -> None:
    """p was 16-bit and is fp32 now (``model.float()``): its value is its master's (the param
    held it rounded to 16 bits)."""
    if "master" in state:
        _local(p).copy_(_local(state["master"]))
    elif "master_remainder" in state:
        local = _local(p)
        local.copy_(remainder_join(local.to(torch.bfloat16), _local(state["master_remainder"])))
