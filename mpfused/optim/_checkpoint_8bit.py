"""The 8-bit block-wise checkpoint format, for every optimizer with 8-bit state (the ``State8bit``
mixin, mpfused/optim/state8bit.py, which describes the format): which state keys are codes
(``QuantState``, from the optimizer's ``_QUANT_STATES``), the 8-bit settings checks, format
version 2 (bitsandbytes' key names; version 1 and torch / bitsandbytes state_dicts load too) and
the exports to torch and bitsandbytes. Nothing here names an optimizer's state keys."""
from __future__ import annotations

import re
import torch

from mpfused.distributed import is_dtensor
from mpfused.distributed import local as _local
from mpfused.distributed_4bit import from_global4, to_global4
from mpfused.distributed_8bit import _from_global, _like_param, _to_global
from mpfused.optim._overrides import _kept_32bit_ids
from mpfused import quant4
from mpfused.optim._quant_state import QuantState, parse_quant_states  # noqa: F401  (re-export)
from mpfused.quant_maps import (BLOCK_SIZES, DEFAULT_BLOCK_SIZE, dequantize_blockwise, num_blocks,
                                quantize_blockwise, signed_map, unsigned_map)

FORMAT_VERSION = 2  # 2: 8-bit entries saved under bitsandbytes' keys (state1, absmax1, ...)
_BNB_BLOCK = DEFAULT_BLOCK_SIZE[8]  # bitsandbytes >= 0.44: its blocks, our 8-bit default
_GROUP_KEYS_8BIT = ("block_size", "min_8bit_size", "optim_bits")


# ---- which state keys are codes: QuantState (mpfused/optim/_quant_state.py) ----------------
def quant_states(optimizer) -> tuple[QuantState, ...]:
    return type(optimizer)._quant


def is_codes(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def is_8bit_state(state, quant) -> bool:
    """A param's state (live, or saved under the live keys) holds 8-bit codes."""
    return any(is_codes(state.get(q.key)) for q in quant)


# ---- settings ------------------------------------------------------------------------------
def _check_block_size(block_size, where: str = "block_size") -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{where} must be one of {BLOCK_SIZES} (a power of two from "
                         f"{BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}, as bitsandbytes), got "
                         f"{block_size!r}")


def check_settings_8bit(group, where: str = "param group", bits: int = 8) -> None:
    """A param group's 8-bit (or 4-bit: ``bits``) settings (add_param_group, a step that sees
    them changed, a load); the optimizer's own group rules are its ``_check_group_rules``."""
    _check_block_size(group["block_size"], f"{where} block_size")
    if group["optim_bits"] not in (bits, 32):
        raise ValueError(f"{where} optim_bits must be {bits} or 32, got {group['optim_bits']!r}")
    size = group["min_8bit_size"]
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{where} min_8bit_size must be an int >= 0, got {size!r}")


def _state_block_size(blocks: int, numel: int, current: int) -> int:
    """The block size a live 8-bit state was quantized with, told by its absmax length: two
    block sizes give the same ceil(numel / block_size) only when both give one block, and then
    the layouts are the same."""
    if blocks == num_blocks(numel, current):
        return current
    for block in BLOCK_SIZES:
        if num_blocks(numel, block) == blocks:
            return block
    raise RuntimeError(f"mpfused: an 8-bit state of {numel} elements has {blocks} absmax "
                       f"entries, which no block size in {BLOCK_SIZES} gives")


def live_block_size(state, quant, numel: int, current: int | None = None) -> int:
    """The block size of a live 8-bit state (it lags a block_size change until the next step),
    told by its absmax length; ``current`` (the group's, where known; default: the state width's,
    DEFAULT_BLOCK_SIZE) only chooses among sizes that give one block (the same layout)."""
    q = next(q for q in quant if is_codes(state.get(q.key)))
    if current is None:
        current = DEFAULT_BLOCK_SIZE[q.bits]
    return _state_block_size(state[q.absmax_key].numel(), numel, current)


# ---- state_dict hooks ------------------------------------------------------------------------
def _add_format(optimizer, state_dict):
    quant = quant_states(optimizer)
    if not getattr(optimizer, "_local_8bit_state_dict", False):
        _globalize(optimizer, state_dict, quant)
    version = optimizer.state_dict_version
    if version not in (1, 2):
        raise ValueError(f"mpfused.{type(optimizer).__name__}: state_dict_version must be 1 or 2, "
                         f"got {version!r}")
    # Version 2: codes never under torch's state keys, where torch.optim would cast them to
    # float and train on them. The live per-param dicts are replaced, never changed.
    saved_keys = {k: s for q in quant
                  for k, s in ((q.key, q.saved_key), (q.absmax_key, q.saved_absmax_key))}
    for pid, saved in state_dict["state"].items():
        if version == 2 and saved and is_8bit_state(saved, quant):
            state_dict["state"][pid] = {saved_keys.get(k, k): v for k, v in saved.items()}
    bits = quant[0].bits
    state_dict["mpfused_8bit"] = {"version": version, **{k: m.clone() for k, m in _maps(bits)}}
    if bits != 8:
        state_dict["mpfused_8bit"]["bits"] = bits
    return state_dict


def _maps(bits: int):
    """The format's (name, map) pairs for a code width (8-bit: bitsandbytes', 4-bit: torchao's)."""
    if bits == 4:
        return (("signed_map", quant4.signed4_map()), ("unsigned_map", quant4.unsigned4_map()))
    return (("signed_map", signed_map()), ("unsigned_map", unsigned_map()))


def _globalize(optimizer, state_dict, quant) -> None:
    """8-bit state of DTensor params in the global layout (mpfused/distributed_8bit.py). The
    per-param dicts of torch's state_dict are the live ones: they are replaced, never changed."""
    ids = (i for g in state_dict["param_groups"] for i in g["params"])
    params = ((g, p) for g in optimizer.param_groups for p in g["params"])
    for pid, (group, p) in zip(ids, params):
        saved = state_dict["state"].get(pid)
        if not saved or not is_dtensor(p) or not is_8bit_state(saved, quant):
            continue
        saved = dict(saved)
        local = _local(p)
        for q in quant:
            if not is_codes(saved.get(q.key)) or is_dtensor(saved[q.key]):
                continue
            to_global = to_global4 if q.bits == 4 else _to_global  # packed: distributed_4bit.py
            saved[q.key], saved[q.absmax_key] = to_global(
                p, saved[q.key], saved[q.absmax_key], q.qmap(local.device), group["block_size"])
        state_dict["state"][pid] = saved


def _where(gi, pi, p) -> str:
    return f"param {pi} of param group {gi} (shape {tuple(_local(p).shape)})"


def _saved_8bit(saved: dict, quant, where: str = "") -> dict:
    """A param's saved state with bitsandbytes' keys (ours since version 2, and bnb's FSDP
    wrapper) mapped to the live ones."""
    saved = dict(saved)
    saved.update(saved.pop("__bnb_optimizer_quant_state__", {}) or {})
    for q in quant:
        for bnb_key, key in ((q.saved_key, q.key), (q.saved_absmax_key, q.absmax_key)):
            if bnb_key in saved and key in saved:
                raise ValueError(
                    f"load_state_dict: {where}: its saved state has both {bnb_key} and {key}; "
                    f"a state_dict holds a state under one of them (version 2 or bitsandbytes: "
                    f"{bnb_key}, version 1: {key})")
            if bnb_key in saved:
                saved[key] = saved.pop(bnb_key)
        saved.pop(f"qmap{q.n}", None)
    saved.pop("unorm_vec", None)
    extra = sorted(k for k in saved if re.fullmatch(r"(state|absmax|qmap)\d+", k))
    if extra:  # e.g. an Adam checkpoint's state2 loaded into a one-state optimizer
        raise ValueError(f"load_state_dict: {where}: its saved state has {extra}, which a "
                         f"state of {len(quant)} quantized tensor(s) does not (a checkpoint of "
                         "another optimizer?)")
    if "step" in saved and not isinstance(saved["step"], torch.Tensor):
        saved["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
    return saved


def _check_saved_kinds(saved, quant, p, where) -> bool:
    """One param's saved states have its shape and are all codes or all floats; True: codes."""
    local = _local(p)
    for q in quant:
        if isinstance(saved.get(q.key), torch.Tensor):
            # DCP + FSDP2 hands DTensors: the global layout (4-bit bytes are chunked otherwise
            # than the param's elements, so the global shapes are compared)
            value = saved[q.key]
            ref = p if is_dtensor(value) else local
            shape = tuple(value.shape)
            want = q.codes_shape(ref.shape) if is_codes(value) else tuple(ref.shape)
            if shape != want:
                raise ValueError(
                    f"load_state_dict: {where}: saved {q.saved_key}/{q.key} has shape {shape}; "
                    f"it must be {want} (the param's (local) shape"
                    + (", 4-bit codes: ceil(numel / 2) bytes, flat)" if q.bits == 4 else ")"))
    codes = [is_codes(saved.get(q.key)) for q in quant]
    if any(codes) and not all(codes):
        kinds = ", ".join(f"{q.saved_key}/{q.key} is " + (
            "uint8 codes" if c else "missing" if saved.get(q.key) is None
            else f"{getattr(saved[q.key], 'dtype', type(saved[q.key]))}")
            for q, c in zip(quant, codes))
        raise ValueError(f"load_state_dict: {where}: {kinds}; a state holds all of them as uint8 "
                         "codes (8-bit) or all as floats (32-bit)")
    return any(codes)


def _told_block_size(saved, quant, p, default: int) -> int:
    """The block size a saved absmax's length gives (``default`` where it gives none, or one
    block: the same layout for every size)."""
    absmax = saved.get(quant[0].absmax_key)
    if not isinstance(absmax, torch.Tensor):
        return default
    numel = (p if is_dtensor(absmax) else _local(p)).numel()
    try:
        return _state_block_size(absmax.numel(), numel, default)
    except RuntimeError:
        return default


def _check_saved_absmax(saved, quant, p, block, where) -> None:
    for q in quant:
        absmax = saved.get(q.absmax_key)
        # A DTensor absmax (DCP) holds the blocks of the whole param, a plain one those of the
        # local tensor.
        numel = (p if is_dtensor(absmax) else _local(p)).numel()
        blocks = num_blocks(numel, block)
        if not isinstance(absmax, torch.Tensor) or absmax.numel() != blocks:
            got = ("missing" if absmax is None else f"{absmax.numel()} entries"
                   if isinstance(absmax, torch.Tensor) else f"a {type(absmax).__name__}")
            raise ValueError(
                f"load_state_dict: {where}: {q.saved_absmax_key}/{q.absmax_key} is {got}, but "
                f"ceil(numel / block_size) = ceil({numel} / {block}) = {blocks} are required "
                "(a checkpoint quantized with another block size, e.g. bitsandbytes < 0.44 "
                "used 2048?)")


def _check_and_stash_8bit(optimizer, state_dict):
    """Validate (before anything changes) and keep the 8-bit tensors aside; make the saved param
    groups ours (foreign keys dropped, missing 8-bit settings taken from this optimizer)."""
    quant = quant_states(optimizer)
    fmt = state_dict.get("mpfused_8bit")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    # ours: the format key, or (when a checkpointer kept only state and param_groups) our keys
    ours = fmt is not None or any("block_size" in g for g in saved_groups)
    if fmt is not None:
        if int(fmt.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"mpfused_8bit state_dict version {fmt['version']} is newer than this "
                             f"mpfused (version {FORMAT_VERSION})")
        bits = int(fmt.get("bits", 8))
        if bits != quant[0].bits:
            raise ValueError(f"load_state_dict: the checkpoint holds {bits}-bit state; "
                             f"mpfused.{type(optimizer).__name__} keeps {quant[0].bits}-bit state "
                             "(load it into the optimizer that saved it, or convert through "
                             "to_torch_state_dict())")
        for name, qmap in _maps(bits):
            saved_map = fmt.get(name)
            if saved_map is not None and not torch.equal(saved_map.cpu().float(), qmap):
                raise ValueError(f"the checkpoint's {name} differs from the map used here: its "
                                 "codes cannot be decoded")
    groups = []
    for gi, (sg, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        sg = optimizer._adopt_saved_group(sg)  # e.g. bitsandbytes' SGD keeps momentum in betas
        g = {k: v for k, v in sg.items()
             if k in optimizer.defaults or k in ("params", "param_names")}
        for k in optimizer.defaults:
            g.setdefault(k, group[k])
        if not ours:  # bnb groups carry optim_bits=32 and no block size: not ours
            g.update({k: group[k] for k in _GROUP_KEYS_8BIT})
        optimizer._check_group_8bit(g, f"load_state_dict: param group {gi}")
        groups.append(g)
    new_state = {}
    for gi, (sg, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for pi, (pid, p) in enumerate(zip(sg["params"], group["params"])):
            if pid not in saved_state:
                continue
            where = _where(gi, pi, p)
            saved = new_state[pid] = _saved_8bit(saved_state[pid], quant, where)
            if not _check_saved_kinds(saved, quant, p, where):
                continue
            # not ours (no format key, no block size): the size its absmax length tells, else
            # the width's default (bitsandbytes' 256, torchao's 4-bit 128)
            block = (sg.get("block_size", group["block_size"]) if ours
                     else _told_block_size(saved, quant, p, DEFAULT_BLOCK_SIZE[quant[0].bits]))
            if block != group["block_size"]:
                how = "saved with" if ours else "(no block size saved; its absmax length tells)"
                raise ValueError(
                    f"load_state_dict: {where}: its 8-bit state was {how} "
                    f"block_size={block}, this optimizer uses block_size={group['block_size']}; "
                    "a block-wise state is only valid for the block size it was quantized with. "
                    f"Construct the optimizer with block_size={block}.")
            _check_saved_absmax(saved, quant, p, block, where)
    optimizer._loading_8bit = (saved_groups, new_state)
    out = {k: v for k, v in state_dict.items() if k != "mpfused_8bit"}
    out.update(state=new_state, param_groups=groups)
    return out


def _restore_8bit(optimizer):
    """After torch's load (and the engine's fp32 restore): 8-bit tensors with their own dtypes
    on the param's device, then every state in the form its param wants."""
    quant = quant_states(optimizer)
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
        for q in quant:
            codes, absmax = saved.get(q.key), saved.get(q.absmax_key)
            if (is_codes(codes) and isinstance(absmax, torch.Tensor)
                    and (is_dtensor(codes) or is_dtensor(absmax))):  # DCP: the global layout
                from_global = from_global4 if q.bits == 4 else _from_global
                saved[q.key], saved[q.absmax_key] = from_global(
                    p, codes, absmax, q.qmap(local.device), group["block_size"])
        for q in quant:
            for key in (q.key, q.absmax_key):
                value = saved.get(key)
                if isinstance(value, torch.Tensor) and (is_codes(value) or key == q.absmax_key):
                    dtype = torch.uint8 if is_codes(value) else torch.float32
                    # a copy: never the caller's tensors (e.g. a live optimizer's state_dict())
                    state[key] = _local(value).to(device=local.device, dtype=dtype, copy=True,
                                                  memory_format=torch.contiguous_format)
        for q in quant:
            if q.key in state and not is_codes(state[q.key]):
                state.pop(q.absmax_key, None)
        if any(q.key in state for q in quant):
            optimizer._sync_form(group, p, optimizer._wants_8bit(group, p, kept))


# ---- exports --------------------------------------------------------------------------------
def to_torch_state_dict(optimizer) -> dict:
    """The state_dict of the 32-bit optimizer: fp32 state (codes dequantized; DTensors for
    DTensor params), the step counters, the group keys ``optimizer._torch_group`` gives."""
    quant = quant_states(optimizer)
    optimizer._local_8bit_state_dict = True  # the local codes are dequantized below
    try:
        sd = optimizer.state_dict()
    finally:
        del optimizer._local_8bit_state_dict
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    groups_of = {i: g for g in optimizer.param_groups for i in [id(q) for q in g["params"]]}
    state = {}
    for pid, p in zip(ids, params):
        saved = sd["state"].get(pid)
        if not saved:
            continue
        saved = _saved_8bit(saved, quant)  # the live key names
        out = {"step": saved["step"].detach().float().reshape(()).cpu().clone()}  # no alias
        if is_8bit_state(saved, quant):
            block = live_block_size(saved, quant, _local(p).numel(),
                                    groups_of[id(p)]["block_size"])
        for q in quant:
            v = saved.get(q.key)
            if is_codes(v):  # local codes: a DTensor param gets a DTensor state
                m = q.dequantize(_local(v), _local(saved[q.absmax_key]), block,
                                 _local(p).shape)
                out[q.key] = _like_param(m, p)
            elif isinstance(v, torch.Tensor):
                out[q.key] = v.detach().clone().float()
        state[pid] = out
    return {"state": state, "param_groups": [optimizer._torch_group(g)
                                             for g in sd["param_groups"]]}


def to_bitsandbytes_state_dict(optimizer) -> dict:
    """The state_dict of bitsandbytes' 8-bit optimizer over the same params and groups: per
    param ``step`` (int), ``state{n}`` with ``qmap{n}`` and ``absmax{n}`` (codes in 256-element
    blocks: another block size is re-quantized, nearest codes of the new blocks, not bit-exact)
    for 8-bit params, fp32 ``state{n}`` otherwise; groups as ``optimizer._bnb_group`` gives."""
    quant = quant_states(optimizer)
    if quant[0].bits != 8:
        raise ValueError(f"to_bitsandbytes_state_dict: mpfused.{type(optimizer).__name__} keeps "
                         f"{quant[0].bits}-bit state, which bitsandbytes has no optimizer for")
    state, groups, index = {}, [], 0
    for gi, group in enumerate(optimizer.param_groups):
        if any(is_dtensor(p) for p in group["params"]):
            raise NotImplementedError(
                f"to_bitsandbytes_state_dict: param group {gi} has DTensor params; "
                "bitsandbytes' optimizers take plain tensors (use state_dict() with DCP)")
        if group["maximize"]:
            raise ValueError(f"to_bitsandbytes_state_dict: param group {gi} has "
                             "maximize=True, which bitsandbytes does not support")
        keys = optimizer._bnb_group(gi, group)
        ids = []
        for p in group["params"]:
            ids.append(index)
            if optimizer.state.get(p):
                state[index] = _bnb_entry(group, p, optimizer.state[p], quant)
            index += 1
        lr = group["lr"]
        groups.append({"lr": float(lr.item() if isinstance(lr, torch.Tensor) else lr), **keys,
                       "params": ids})
    return {"state": state, "param_groups": groups}


def _bnb_entry(group, p, st, quant) -> dict:
    """One param's state in bitsandbytes' layout (new tensors: never the live ones)."""
    entry = {"step": int(st["step"].item())}
    if not is_8bit_state(st, quant):
        entry.update({q.saved_key: st[q.key].detach().float().clone()
                      for q in quant if q.key in st})
        return entry
    block = live_block_size(st, quant, p.numel(), group["block_size"])
    for q in quant:
        codes, absmax = st[q.key], st[q.absmax_key]
        qmap = q.qmap(codes.device)
        if block != _BNB_BLOCK:
            codes, absmax = quantize_blockwise(
                dequantize_blockwise(codes, absmax, qmap, block), qmap, _BNB_BLOCK)
        entry.update({q.saved_key: codes.clone(), q.saved_absmax_key: absmax.clone(),
                      f"qmap{q.n}": qmap.clone()})
    return entry
