"""The fp32 checkpoint format of the optimizers: their state_dict hooks. fp32 state stays fp32 on
load (torch casts it to the param's dtype), every tensor is copied, torch's own state_dicts load,
8-bit ones are refused clearly. The 8-bit block-wise format is mpfused/optim/_checkpoint_8bit.py."""
from __future__ import annotations

import torch

from mpfused.distributed import local as _local


def _plain_dicts(optimizer, state_dict):
    """A state_dict holds plain dicts, not the tracked ones of optimizer.state: checkpoints never
    name an mpfused class (weights_only loads, other libraries)."""
    state_dict["state"] = {k: dict(v) if isinstance(v, dict) else v
                           for k, v in state_dict["state"].items()}
    return state_dict


# ---- state_dict: keep fp32 state fp32 --------------------------------------------------------
# torch's load_state_dict casts every floating state tensor to the param's dtype (and an int16
# remainder to bf16!). The pre-hook validates the saved state against the params (before anything
# changes) and keeps the saved tensors aside; the post-hook puts them back with their own dtype on
# the param's device (floating state as fp32, integer state as saved), converting a
# torch.optim.AdamW state on the way (16-bit moments become fp32, a missing master is taken from
# the param).
# master_remainder8: the int8 correction of master_weights="remainder8" (bits 8..15 of the master
# rounded to 24 bits; the param holds bits 16..31 rounded to nearest), saved as is.
PER_ELEMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "master",
                    "master_remainder", "master_remainder8")
# AdamW8bit (v2) / bitsandbytes (>= 0.49.2 nests its quantized keys under the last one)
_8BIT_SAVED_KEYS = ("state1", "state2", "absmax1", "absmax2", "__bnb_optimizer_quant_state__")


def check_state_shape(value: torch.Tensor, local: torch.Tensor, where: str) -> None:
    """Per-element state has its param's (local) shape; DCP + FSDP2 hand DTensor state of the
    global shape: its local shard is compared."""
    if _local(value).shape != local.shape:
        raise ValueError(f"{where} has shape {tuple(_local(value).shape)} but its param has shape "
                         f"{tuple(local.shape)}; per-element state must have the param's shape")


def _allowed_state_dtypes(optimizer, key):
    """None: any floating dtype (cast to fp32 on load); else the exact dtypes accepted."""
    if key == "master_remainder":
        return (torch.int16,)
    if key == "master_remainder8":
        return (torch.int8,)
    if any(key == k for k, _ in optimizer._QUANT_STATES):
        return (torch.uint8, torch.float32, torch.float16, torch.bfloat16)  # codes or 32-bit
    return None


def _saved_pairs(optimizer, saved_groups):
    """(saved id, param, group) in torch's matching order: groups in order, params in order."""
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for pid, p in zip(saved["params"], group["params"]):
            yield pid, p, group


def _from_bitsandbytes_32bit(optimizer, saved: dict) -> dict | None:
    """A bitsandbytes 32-bit optimizer's per-param state (state1/state2 floating, nested under
    __bnb_optimizer_quant_state__ since 0.49.2) with the optimizer's own keys
    (``_BNB_STATE_KEYS``, bitsandbytes' order); None when it is not one."""
    inner = saved.get("__bnb_optimizer_quant_state__", saved)
    if not isinstance(inner, dict) or "state1" not in inner or not optimizer._BNB_STATE_KEYS:
        return None
    names = ("state1", "state2")[:len(optimizer._BNB_STATE_KEYS)]
    values = [inner.get(n) for n in names]
    if any(k in inner for k in ("absmax1", "absmax2", "qmap1", "qmap2")) or not all(
            isinstance(v, torch.Tensor) and v.is_floating_point() for v in values):
        return None  # 8-bit (or not a state this optimizer keeps): refused below
    out = {k: v for k, v in saved.items() if k != "__bnb_optimizer_quant_state__"
           and k not in ("state1", "state2")}
    out.update(zip(optimizer._BNB_STATE_KEYS, values))
    return out


def _stash_fp32_state(optimizer, state_dict):
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    quantized = bool(optimizer._QUANT_STATES)
    if not quantized:  # a bitsandbytes 32-bit checkpoint (Adam/AdamW, SGD, Lion) loads as is
        converted = {pid: _from_bitsandbytes_32bit(optimizer, v) if isinstance(v, dict) else None
                     for pid, v in saved_state.items()}
        if any(v is not None for v in converted.values()):
            saved_state = {pid: converted[pid] if converted[pid] is not None else v
                           for pid, v in saved_state.items()}
            # its groups carry bitsandbytes' keys (optim_bits, SGD's momentum in betas, ...)
            groups = []
            for sg, group in zip(saved_groups, optimizer.param_groups):
                sg = optimizer._adopt_saved_group(sg)
                g = {k: v for k, v in sg.items()
                     if k in optimizer.defaults or k in ("params", "param_names")}
                groups.append({**{k: group[k] for k in optimizer.defaults}, **g})
            saved_groups = groups
            state_dict = {**state_dict, "state": saved_state, "param_groups": groups}
    for pid, p, _ in _saved_pairs(optimizer, saved_groups):
        local = _local(p)
        saved = saved_state.get(pid, {})
        if not quantized and (any(k in saved for k in _8BIT_SAVED_KEYS) or any(
                isinstance(saved.get(k), torch.Tensor) and saved[k].dtype == torch.uint8
                for k in PER_ELEMENT_KEYS)):
            raise ValueError(
                f"loaded state_dict: state[{pid}] holds 8-bit optimizer state (an mpfused 8-bit "
                f"or bitsandbytes checkpoint); mpfused.{type(optimizer).__name__} keeps fp32 "
                "state. Load it into the mpfused 8-bit optimizer (AdamW8bit, SGD8bit, Lion8bit) "
                "and use its to_torch_state_dict(), which dequantizes the state")
        for key in PER_ELEMENT_KEYS:
            value = saved_state.get(pid, {}).get(key)
            # DCP + FSDP2 hands DTensor state (global shape): compare its local shard.
            if not isinstance(value, torch.Tensor):
                continue
            if value.dtype == torch.uint8 and getattr(optimizer, "_STATE_BITS", 8) == 4:
                continue  # flat packed 4-bit codes: checked by _checkpoint_8bit's pre-hook
            check_state_shape(value, local, f"loaded state_dict: state[{pid}][{key!r}]")
            allowed = _allowed_state_dtypes(optimizer, key)
            if not (value.is_floating_point() if allowed is None else value.dtype in allowed):
                raise ValueError(
                    f"loaded state_dict: state[{pid}][{key!r}] has dtype {value.dtype}; "
                    f"{key} must be {'a floating tensor' if allowed is None else allowed}")
    optimizer._loading = (saved_groups, saved_state)
    return state_dict


def _restore_fp32_state(optimizer):
    saved_groups, saved_state = optimizer.__dict__.pop("_loading")
    optimizer._plans = {}
    for pid, p, group in _saved_pairs(optimizer, saved_groups):
        if pid not in saved_state:
            continue
        state, local = optimizer.state[p], _local(p)
        for key, value in saved_state[pid].items():
            if key == "step" and isinstance(value, (int, float)):  # torch < 1.12 saved a number
                value = torch.tensor(float(value))
            if not isinstance(value, torch.Tensor):
                continue
            # copy=True: .to() returns the state_dict's own tensor when dtype and device match,
            # and two optimizers loaded from one state_dict would step each other's state
            dtype = torch.float32 if key == "step" or value.is_floating_point() else value.dtype
            state[key] = value.to(device=local.device, dtype=dtype, copy=True)
            if key == "step":
                state[key] = state[key].reshape(())
        # a torch checkpoint has no masters: taken from p, not its local shard (a DTensor param
        # gets DTensor state; a plain local tensor would be saved by DCP as if replicated)
        optimizer._sync_state_keys(group, p, optimizer._master_mode(group, p))
