"""Params whose optimizer state stays 32-bit in the 8-bit optimizers: ``keep_32bit_state`` and
bitsandbytes' own ``GlobalOptimManager`` overrides (read, never changed), with a value that
changes whenever they may have (cached kernel plans are rebuilt then)."""
from __future__ import annotations

import sys
import weakref

import torch

__all__ = ["keep_32bit_state"]


# ---- per-param 32-bit override ---------------------------------------------------------------
_KEEP32_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_OVERRIDES = [0]  # bumped on every registration: cached kernel plans are rebuilt
_LAST_EPOCH = [(0,)]  # the last value of _overrides_epoch()


def keep_32bit_state(module_or_params, enabled: bool = True) -> None:
    """Keep fp32 optimizer state for these params in every ``AdamW8bit``/``Adam8bit``: a module
    (all its parameters, resolved at each step, so params replaced later, e.g. by FSDP2, are
    covered), a parameter, or an iterable of either. The usual case is embeddings (8-bit
    embedding state is known to destabilize training). Takes effect at the next step, converting
    existing state.

    ``enabled=False`` undoes an earlier call for the same modules / params. A param still stays
    32-bit while another registered module contains it, or while bitsandbytes'
    ``GlobalOptimManager`` keeps it at 32 bits."""
    items = [module_or_params] if isinstance(module_or_params, (torch.nn.Module, torch.Tensor)) \
        else list(module_or_params)
    for item in items:  # all checked first: a rejected call registers nothing
        if not isinstance(item, (torch.nn.Module, torch.Tensor)):
            raise TypeError(f"keep_32bit_state takes modules or parameters, got {type(item)}")
    for item in items:
        if isinstance(item, torch.nn.Module):
            (_KEEP32_MODULES.add if enabled else _KEEP32_MODULES.discard)(item)
        elif enabled:
            item._mpfused_optim_bits = 32
        else:
            item.__dict__.pop("_mpfused_optim_bits", None)
    _OVERRIDES[0] += 1


def _kept_32bit_ids() -> set[int]:
    return {id(p) for m in list(_KEEP32_MODULES) for p in m.parameters()} | _bnb_32bit_ids()


def _bnb_manager():
    """bitsandbytes' GlobalOptimManager instance, or None. Never imports bitsandbytes (only reads
    it when the user already did) and never creates the instance (get_instance() would)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    return getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)


def _bnb_32bit_ids() -> set[int]:
    """ids of the params bitsandbytes keeps at optim_bits=32: ``override_config`` (pid2config,
    keyed by id(p)) and ``register_module_override`` (module_weight_config_triple, resolved to
    the module's current param, as bnb's first step does, and winning over pid2config as there).
    index2config is positional (a (group, param) index into whatever optimizer registered it)
    and is filled from pid2config, so it is not read. Read only: nothing here changes bnb."""
    mng = _bnb_manager()
    if mng is None:
        return set()
    bits = {pid: cfg.get("optim_bits") for pid, cfg in dict(getattr(mng, "pid2config", {})).items()
            if isinstance(cfg, dict)}
    for module, name, cfg in list(getattr(mng, "module_weight_config_triple", [])):
        p = getattr(module, name, None)
        if isinstance(p, torch.Tensor) and isinstance(cfg, dict):
            bits[id(p)] = cfg.get("optim_bits", bits.get(id(p)))
    return {pid for pid, b in bits.items() if b == 32}


def _overrides_epoch() -> tuple:
    """A value that changes whenever the 32-bit overrides may have (cached kernel plans are
    rebuilt then). bnb's registrations are seen by their count: a config dict edited in place
    is not seen until the plan is rebuilt for another reason. The same tuple object while the
    value is the same: gradient release keeps its armed calls only while every plan option is
    the same object as when they were made (_release_update._calls_signature)."""
    mng = _bnb_manager()
    value = (_OVERRIDES[0],) if mng is None else (
        _OVERRIDES[0], len(getattr(mng, "pid2config", ())),
        len(getattr(mng, "module_weight_config_triple", ())))
    if value != _LAST_EPOCH[0]:
        _LAST_EPOCH[0] = value
    return _LAST_EPOCH[0]
