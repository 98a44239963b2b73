"""Conversion between ``mpfused.AdamW4bit`` state and ``torchao.optim.AdamW4bit`` state.

torchao keeps a 4-bit state as ``OptimState4bit(codes, scale, qmap, signed, shape)``: ``codes``
flat uint8, element 2k in the high nibble (``(c[::2] << 4) | c[1::2]``), ``scale`` one float32
absmax per ``block_size`` elements (clamped at 1e-12 when it encodes; our absmax is exactly 0
for an all-zero block, which decodes to 0 under both), ``qmap`` the same 16-entry maps as
mpfused/quant4.py (byte-equal, tested). Decoding is ``qmap[code] * scale`` in both, so codes and
scales are copied as they are and the moments are the same floats on both sides.

torchao quantizes only tensors with >= 4096 elements and a size divisible by its block size; our
4-bit state of any other tensor goes to torchao as fp32 (dequantized), torchao's fp32 state comes
to us as floats (quantized by load_state_dict where our rules want 4-bit). Masters have no place
in torchao's state and are dropped (torchao's ``bf16_stochastic_round`` is an optimizer attribute).
DTensor (FSDP2) params: torchao's optimizer under FSDP2 keeps, per param, a DTensor with the
param's mesh, placements and global shape whose local tensor is an ``OptimState4bit`` of the
local shard (blocks and nibble pairs counted from the shard's first element; quantized when the
*local* numel is >= 4096 and a multiple of block_size, else a plain fp32 local tensor). That is
our live layout, so both directions convert the local shards byte for byte, with no collective:
the export is the state torchao's own optimizer would hold on the same mesh (what
``torchao.optim.AdamW4bit(fsdp_model.parameters()).load_state_dict`` takes, and what torchao
hands to DCP), not a gathered single-process state: torchao's FSDP2 state is per shard (its
own ``full_tensor()`` of it concatenates the shards' codes and scales, which is the whole param's
state only for shards of whole blocks). A shard torchao would keep in fp32 is dequantized (an
fp32 DTensor); on import, fp32 shards are quantized where our rule (on the global numel) wants
4-bit. Both sides must have the same mesh and placements (as for torchao's own state_dict).
"""
from __future__ import annotations

import torch

from mpfused.distributed import is_dtensor
from mpfused.distributed import local as _local
from mpfused.distributed_8bit import _like_param
from mpfused.optim._checkpoint_8bit import FORMAT_VERSION, is_codes, quant_states


def _torchao_state_class():
    from torchao.optim.subclass_4bit import OptimState4bit
    return OptimState4bit


def to_torchao_state_dict(optimizer) -> dict:
    """A state_dict ``torchao.optim.AdamW4bit(params, block_size=group block_size)`` loads."""
    OptimState4bit = _torchao_state_class()
    quant = quant_states(optimizer)
    state, groups, index = {}, [], 0
    for gi, group in enumerate(optimizer.param_groups):
        block = group["block_size"]
        ids = []
        for p in group["params"]:
            ids.append(index)
            st = optimizer.state.get(p)
            if st:
                entry = {"step": st["step"].detach().float().reshape(()).cpu().clone()}
                for q in quant:
                    v = st.get(q.key)
                    if not isinstance(v, torch.Tensor):
                        continue
                    local = _local(p)  # torchao decides on the local shard, as here
                    if is_codes(v) and local.numel() >= 4096 and local.numel() % block == 0:
                        entry[q.key] = _like_torchao(p, OptimState4bit(
                            v.clone(), st[q.absmax_key].clone(), q.qmap(v.device).clone(),
                            q.signed, tuple(local.shape)))
                    elif is_codes(v):
                        entry[q.key] = _like_param(
                            q.dequantize(v, st[q.absmax_key], block, local.shape), p)
                    else:
                        entry[q.key] = v.detach().float().clone()
                state[index] = entry
            index += 1
        lr = group["lr"]
        groups.append({"lr": torch.tensor(float(lr), dtype=torch.float32),
                       "betas": tuple(float(b) for b in group["betas"]),
                       "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                       "amsgrad": False, "params": ids})
    return {"state": state, "param_groups": groups}


def _like_torchao(p, state):
    """torchao's state of DTensor param p: the local subclass in a DTensor of p's layout."""
    if not is_dtensor(p):
        return state
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(state, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def from_torchao_state_dict(optimizer, state_dict: dict) -> None:
    """Load a ``torchao.optim.AdamW4bit`` state_dict: its 4-bit states' codes and scales byte for
    byte (their block size must be the group's), its fp32 states as floats."""
    OptimState4bit = _torchao_state_class()
    quant = quant_states(optimizer)
    state = {}
    for pid, saved in state_dict["state"].items():
        entry = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).reshape(()).clone()}
        for q in quant:
            v = saved.get(q.key)
            if is_dtensor(v) and isinstance(v.to_local(), OptimState4bit):
                v = v.to_local()  # FSDP2: the local shard's codes (our live, local layout)
            if isinstance(v, OptimState4bit):
                entry[q.saved_key] = v.codes.detach().clone()
                entry[q.saved_absmax_key] = v.scale.detach().float().clone()
                if v.signed != q.signed or not torch.equal(v.qmap.cpu(), q.qmap()):
                    raise ValueError(f"from_torchao_state_dict: param {pid}'s {q.key} uses a map "
                                     "other than torchao's default 4-bit map")
            elif isinstance(v, torch.Tensor):
                entry[q.key] = v.detach().float().clone()
        state[pid] = entry
    groups = []
    for sg, group in zip(state_dict["param_groups"], optimizer.param_groups):
        g = {k: v for k, v in sg.items() if k in ("betas", "eps", "weight_decay", "params")}
        lr = sg.get("lr", group["lr"])
        g["lr"] = lr if isinstance(group["lr"], torch.Tensor) else float(lr)
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups,
                               "mpfused_8bit": {"version": FORMAT_VERSION, "bits": 4}})
