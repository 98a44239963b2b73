"""The 8-bit block-wise checkpoint format of ``AdamW8bit`` / ``Adam8bit``: its settings checks
and format version 2 (bitsandbytes' key names; version 1 and torch / bitsandbytes state_dicts
load too), described in mpfused/optim/adamw8bit.py."""
from __future__ import annotations

import torch

from mpfused.distributed import is_dtensor
from mpfused.distributed import local as _local
from mpfused.distributed_8bit import _from_global, _to_global
from mpfused.optim._overrides import _kept_32bit_ids
from mpfused.quant_maps import num_blocks, signed_map, unsigned_map

# ---- 8-bit state ------------------------------------------------------------------------------

def is_8bit_state(state) -> bool:
    """A param's live state holds 8-bit codes (uint8 exp_avg)."""
    return "exp_avg" in state and state["exp_avg"].dtype == torch.uint8


BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' CUDA set
FORMAT_VERSION = 2  # 2: 8-bit entries saved under bitsandbytes' keys (state1, absmax1, ...)
_BNB_BLOCK = 256  # bitsandbytes >= 0.44
_8BIT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
_BNB_KEYS = {"state1": "exp_avg", "state2": "exp_avg_sq", "absmax1": "exp_avg_absmax",
             "absmax2": "exp_avg_sq_absmax"}
_SAVED_KEYS = {key: bnb_key for bnb_key, key in _BNB_KEYS.items()}  # live -> saved (version 2)
_TORCH_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                     "capturable", "differentiable", "fused")

def _check_block_size(block_size, where: str = "block_size") -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{where} must be one of {BLOCK_SIZES} (a power of two from 64 to "
                         f"4096, as bitsandbytes), got {block_size!r}")


def _check_group_8bit(group, where: str = "param group") -> None:
    """A param group's 8-bit settings (add_param_group, and again when a step sees them
    changed)."""
    _check_block_size(group["block_size"], f"{where} block_size")
    if group["optim_bits"] not in (8, 32):
        raise ValueError(f"{where} optim_bits must be 8 or 32, got {group['optim_bits']!r}")
    size = group["min_8bit_size"]
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{where} min_8bit_size must be an int >= 0, got {size!r}")
    if group.get("amsgrad"):
        raise ValueError(f"{where} amsgrad=True is not supported (as bitsandbytes); use "
                         "mpfused.AdamW")


def _state_block_size(state, numel: int, current: int) -> int:
    """The block size a live 8-bit state was quantized with, told by its absmax length: two
    block sizes give the same ceil(numel / block_size) only when both give one block, and then
    the layouts are the same."""
    blocks = state["exp_avg_absmax"].numel()
    if blocks == num_blocks(numel, current):
        return current
    for block in BLOCK_SIZES:
        if num_blocks(numel, block) == blocks:
            return block
    raise RuntimeError(f"mpfused.AdamW8bit: an 8-bit state of {numel} elements has {blocks} "
                       f"absmax entries, which no block size in {BLOCK_SIZES} gives")


# ---- state_dict hooks ------------------------------------------------------------------------
def _add_format(optimizer, state_dict):
    if not getattr(optimizer, "_local_8bit_state_dict", False):
        _globalize(optimizer, state_dict)
    version = optimizer.state_dict_version
    if version not in (1, 2):
        raise ValueError(f"mpfused.{type(optimizer).__name__}: state_dict_version must be 1 or 2, "
                         f"got {version!r}")
    # Version 2: codes never under torch's moment keys, where torch.optim would cast them to
    # float and train on them. The live per-param dicts are replaced, never changed.
    for pid, saved in state_dict["state"].items():
        if version == 2 and saved and is_8bit_state(saved):
            state_dict["state"][pid] = {_SAVED_KEYS.get(k, k): v for k, v in saved.items()}
    state_dict["mpfused_8bit"] = {"version": version, "signed_map": signed_map().clone(),
                                  "unsigned_map": unsigned_map().clone()}
    return state_dict


def _globalize(optimizer, state_dict) -> None:
    """8-bit state of DTensor params in the global layout (see above). The per-param dicts of
    torch's state_dict are the live ones: they are replaced, never changed."""
    ids = (i for g in state_dict["param_groups"] for i in g["params"])
    params = ((g, p) for g in optimizer.param_groups for p in g["params"])
    for pid, (group, p) in zip(ids, params):
        saved = state_dict["state"].get(pid)
        if not saved or not is_dtensor(p) or not is_8bit_state(saved):
            continue
        saved = dict(saved)
        local = _local(p)
        for key, qmap, absmax_key in (("exp_avg", signed_map, "exp_avg_absmax"),
                                      ("exp_avg_sq", unsigned_map, "exp_avg_sq_absmax")):
            if is_dtensor(saved[key]):
                continue
            saved[key], saved[absmax_key] = _to_global(p, saved[key], saved[absmax_key],
                                                       qmap(local.device), group["block_size"])
        state_dict["state"][pid] = saved


def _where(gi, pi, p) -> str:
    return f"param {pi} of param group {gi} (shape {tuple(_local(p).shape)})"


def _saved_8bit(saved: dict, where: str = "") -> dict:
    """A param's saved state with bitsandbytes' keys (ours since version 2, and bnb's FSDP
    wrapper) mapped to the live ones."""
    saved = dict(saved)
    saved.update(saved.pop("__bnb_optimizer_quant_state__", {}) or {})
    for bnb_key, key in _BNB_KEYS.items():
        if bnb_key in saved and key in saved:
            raise ValueError(
                f"load_state_dict: {where}: its saved state has both {bnb_key} and {key}; "
                f"a state_dict holds a moment under one of them (version 2 or bitsandbytes: "
                f"{bnb_key}, version 1: {key})")
        if bnb_key in saved:
            saved[key] = saved.pop(bnb_key)
    for key in ("qmap1", "qmap2", "unorm_vec"):
        saved.pop(key, None)
    if "step" in saved and not isinstance(saved["step"], torch.Tensor):
        saved["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
    return saved


def _check_and_stash_8bit(optimizer, state_dict):
    """Validate (before anything changes) and keep the 8-bit tensors aside; make the saved param
    groups ours (foreign keys dropped, missing 8-bit settings taken from this optimizer)."""
    fmt = state_dict.get("mpfused_8bit")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    # ours: the format key, or (when a checkpointer kept only state and param_groups) our keys
    ours = fmt is not None or any("block_size" in g for g in saved_groups)
    if fmt is not None:
        if int(fmt.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"mpfused_8bit state_dict version {fmt['version']} is newer than this "
                             f"mpfused (version {FORMAT_VERSION})")
        for name, qmap in (("signed_map", signed_map()), ("unsigned_map", unsigned_map())):
            saved_map = fmt.get(name)
            if saved_map is not None and not torch.equal(saved_map.cpu().float(), qmap):
                raise ValueError(f"the checkpoint's {name} differs from bitsandbytes' dynamic map "
                                 "used here: its codes cannot be decoded")
    for gi, sg in enumerate(saved_groups):
        if sg.get("amsgrad"):
            raise ValueError(
                f"load_state_dict: param group {gi} was saved with amsgrad=True; "
                f"mpfused.{type(optimizer).__name__} does not support amsgrad (as bitsandbytes): "
                "load it into mpfused.AdamW(amsgrad=True)")
    new_state = {}
    for gi, (sg, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for pi, (pid, p) in enumerate(zip(sg["params"], group["params"])):
            if pid not in saved_state:
                continue
            saved = _saved_8bit(saved_state[pid], _where(gi, pi, p))
            new_state[pid] = saved
            local = _local(p)
            moment = saved.get("exp_avg")
            if not isinstance(moment, torch.Tensor):
                continue
            moment = _local(moment)  # DCP + FSDP2 hands DTensors: compare the local shard
            if tuple(moment.shape) != tuple(local.shape):
                raise ValueError(
                    f"load_state_dict: {_where(gi, pi, p)}: saved state1/exp_avg has shape "
                    f"{tuple(moment.shape)}; optimizer state must have the param's (local) shape")
            second = saved.get("exp_avg_sq")
            if (moment.dtype == torch.uint8) != (isinstance(second, torch.Tensor)
                                                 and second.dtype == torch.uint8):
                kinds = ["uint8 codes" if isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                         else "missing" if t is None else f"{getattr(t, 'dtype', type(t))}"
                         for t in (moment, second)]
                raise ValueError(
                    f"load_state_dict: {_where(gi, pi, p)}: its first moment (state1/exp_avg) is "
                    f"{kinds[0]} but its second (state2/exp_avg_sq) is {kinds[1]}; a state holds "
                    "both moments as uint8 codes (8-bit) or both as floats (32-bit)")
            if moment.dtype != torch.uint8:
                continue
            block = sg.get("block_size", group["block_size"]) if ours else _BNB_BLOCK
            if block != group["block_size"]:
                raise ValueError(
                    f"load_state_dict: {_where(gi, pi, p)}: its 8-bit state was saved with "
                    f"block_size={block}, this optimizer uses block_size={group['block_size']}; "
                    "a block-wise state is only valid for the block size it was quantized with. "
                    f"Construct the optimizer with block_size={block}.")
            for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
                absmax = saved.get(key)
                # A DTensor absmax (DCP) holds the blocks of the whole param, a plain one those
                # of the local tensor.
                numel = (p if is_dtensor(absmax) else local).numel()
                blocks = num_blocks(numel, block)
                if not isinstance(absmax, torch.Tensor) or absmax.numel() != blocks:
                    got = ("missing" if absmax is None else f"{absmax.numel()} entries"
                           if isinstance(absmax, torch.Tensor) else f"a {type(absmax).__name__}")
                    raise ValueError(
                        f"load_state_dict: {_where(gi, pi, p)}: {_SAVED_KEYS[key]}/{key} is "
                        f"{got}, but "
                        f"ceil(numel / block_size) = ceil({numel} / {block}) = {blocks} "
                        "are required (a checkpoint quantized with another block size, e.g. "
                        "bitsandbytes < 0.44 used 2048?)")
    groups = []
    for sg, group in zip(saved_groups, optimizer.param_groups):
        g = {k: v for k, v in sg.items() if k in optimizer.defaults or k in ("params", "param_names")}
        for k in optimizer.defaults:
            g.setdefault(k, group[k])
        if not ours:
            g["block_size"] = group["block_size"]  # checked above for 8-bit moments
            g["optim_bits"] = group["optim_bits"]  # bnb groups carry optim_bits=32: not ours
            g["min_8bit_size"] = group["min_8bit_size"]
        groups.append(g)
    optimizer._loading_8bit = (saved_groups, new_state)
    out = {k: v for k, v in state_dict.items() if k != "mpfused_8bit"}
    out.update(state=new_state, param_groups=groups)
    return out


def _restore_8bit(optimizer):
    """After torch's load (and mpfused.AdamW's fp32 restore): 8-bit tensors with their own
    dtypes on the param's device, then every state in the form its param wants."""
    saved_groups, saved_state = optimizer.__dict__.pop("_loading_8bit")
    optimizer._plans = {}
    kept = _kept_32bit_ids()
    ids = (i for g in saved_groups for i in g["params"])
    params = ((g, p) for g in optimizer.param_groups for p in g["params"])
    for pid, (group, p) in zip(ids, params):
        saved = saved_state.get(pid)
        if not saved:
            continue
        state, local = optimizer.state[p], _local(p)
        saved = dict(saved)
        for key, qmap, absmax_key in (("exp_avg", signed_map, "exp_avg_absmax"),
                                      ("exp_avg_sq", unsigned_map, "exp_avg_sq_absmax")):
            codes, absmax = saved.get(key), saved.get(absmax_key)
            if (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8
                    and isinstance(absmax, torch.Tensor)
                    and (is_dtensor(codes) or is_dtensor(absmax))):  # DCP: the global layout
                saved[key], saved[absmax_key] = _from_global(
                    p, codes, absmax, qmap(local.device), group["block_size"])
        for key in _8BIT_KEYS:
            value = saved.get(key)
            if isinstance(value, torch.Tensor) and (value.dtype == torch.uint8 or "absmax" in key):
                dtype = torch.uint8 if value.dtype == torch.uint8 else torch.float32
                # a copy: never the caller's tensors (e.g. a live optimizer's state_dict())
                state[key] = _local(value).to(device=local.device, dtype=dtype, copy=True,
                                              memory_format=torch.contiguous_format)
        if "exp_avg" in state and state["exp_avg"].dtype != torch.uint8:
            state.pop("exp_avg_absmax", None)
            state.pop("exp_avg_sq_absmax", None)
        if "exp_avg" in state:
            optimizer._sync_form(group, p, optimizer._wants_8bit(group, p, kept))
