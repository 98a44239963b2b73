"""Conversions between the master forms of a param (``optimizer.state[p]``), for a change of
``master_weights`` or of the param's dtype between steps. An fp32 master and a bf16 param with its
int16 remainder hold the same fp32 value, so each converts to the other without loss (the split
and join of csrc/include/mpfused/adam_math.h, via mpfused.reference.adam). The one-byte
correction (``master_remainder8``) holds the master rounded to 24 bits: converting to it rounds
(to nearest, ties to even), converting from it is exact."""
from __future__ import annotations

import torch

from mpfused.master_modes import FP32_MASTER, REMAINDER, REMAINDER8
from mpfused.reference.adam import (remainder8_join, remainder8_split, remainder_join,
                                    remainder_split)

# The state key of each master mode's masters operand (engine.MASTER_MODES values).
MASTER_STATE_KEYS = {FP32_MASTER: "master", REMAINDER: "master_remainder",
                     REMAINDER8: "master_remainder8"}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def _from_local(p: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    master = p.detach().float()  # p's layout and type (a DTensor when p is one)
    _local(master).copy_(local_value)
    return master


@torch.no_grad()
def master_from_remainder(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that bf16 param p and its remainder hold (a DTensor when p is one)."""
    return _from_local(p, remainder_join(_local(p).detach(), _local(remainder)))


@torch.no_grad()
def master_from_remainder8(p: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The fp32 value (a 24-bit master) that bf16 param p and its int8 correction hold."""
    return _from_local(p, remainder8_join(_local(p).detach(), _local(correction)))


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
def split_master8(p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The int8 correction of fp32 `master` rounded to 24 bits; bf16 param p is set to that
    value's high half rounded to nearest, ties away from zero (remainder8_split)."""
    hi, rem = remainder8_split(_local(master).contiguous())
    correction = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.preserve_format)
    _local(correction).copy_(rem)
    _local(p).copy_(hi)
    return correction


def master_value(p: torch.Tensor, state: dict):
    """The fp32 master the state holds in any form (an fp32 master, an int16 remainder or an
    int8 correction with bf16 p), or None."""
    if "master" in state:
        return state["master"]
    if "master_remainder" in state:
        return master_from_remainder(p, state["master_remainder"])
    if "master_remainder8" in state:
        return master_from_remainder8(p, state["master_remainder8"])
    return None


@torch.no_grad()
def new_master(p: torch.Tensor, state: dict, mode: int) -> torch.Tensor:
    """The masters operand of `mode` for p, converted from the form the state holds (exact, but
    rounded to 24 bits for remainder8), or else taken from the param (the bf16 value is exact in
    every form: a zero remainder / correction)."""
    value = master_value(p, state)
    if mode == 1:
        return p.detach().float() if value is None else value
    int_dtype = torch.int16 if mode == 2 else torch.int8
    if value is None:
        return torch.zeros_like(p, dtype=int_dtype, memory_format=torch.preserve_format)
    return split_master(p, value) if mode == 2 else split_master8(p, value)


@torch.no_grad()
def restore_fp32_param(p: torch.Tensor, state: dict) -> None:
    """p was 16-bit and is fp32 now (``model.float()``): its value is its master's (the param
    held it rounded to 16 bits)."""
    local = _local(p)
    if "master" in state:
        local.copy_(_local(state["master"]))
    elif "master_remainder" in state:
        local.copy_(remainder_join(local.to(torch.bfloat16), _local(state["master_remainder"])))
    elif "master_remainder8" in state:
        local.copy_(remainder8_join(local.to(torch.bfloat16), _local(state["master_remainder8"])))
