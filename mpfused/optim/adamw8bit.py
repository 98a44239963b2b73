"""``mpfused.AdamW8bit`` / ``mpfused.Adam8bit``: AdamW / Adam with block-wise 8-bit moments
(about 2.03 B/param of state instead of 8), in the format of bitsandbytes >= 0.44.

Encoding (csrc/include/mpfused/quant8_math.h, mpfused/quant_maps.py)
--------------------------------------------------------------------
* ``exp_avg`` is stored as uint8 codes into bitsandbytes' signed dynamic map, ``exp_avg_sq``
  into its unsigned map (``create_dynamic_map``, byte-equal to bnb's; 256 sorted float32 values,
  exact 0 at code 127 / 0, max 1.0).
* Each state tensor is cut into blocks of ``block_size`` consecutive elements (row-major order of
  the param; the last block may be short) with one float32 ``absmax`` per block:
  ``value = map[code] * absmax[block]``.
* A step dequantizes with the old absmax, updates in float32 exactly like ``mpfused.AdamW``
  (torch's decoupled decay before the update, torch's bias correction), updates the param with
  these unquantized new moments, takes each block's new absmax from the updated moments and
  stores ``code = nearest map entry to m * (1/absmax)`` (ties to the lower code; the decision is
  exact). bitsandbytes' sign rule: a negative first moment that rounds to 0 is stored one code
  below 0, so it never comes back as 0 or positive.
* bitsandbytes' CUDA kernel decays after the update (its CPU and Triton paths, torch and torchao
  before) and divides per element; states stay interchangeable (same maps and block layout).

Which params get 8-bit state
----------------------------
Params with fewer than ``min_8bit_size`` elements (default 4096, judged on the whole logical
param, also for DTensors) keep fp32 moments and take the ``mpfused.AdamW`` kernel, as do params of
a group with ``optim_bits=32``, params registered with ``keep_32bit_state(module_or_params)``
(e.g. embeddings) and, when bitsandbytes is already imported, params that its
``GlobalOptimManager`` keeps at ``optim_bits=32`` (``override_config(p, "optim_bits", 32)`` or
``register_module_override(module, "weight", {"optim_bits": 32})``, which
``bnb.nn.StableEmbedding`` / ``bnb.nn.Embedding`` call themselves). A change of these settings, or of a group's ``block_size``, converts the existing state at the
next step (a new block size re-quantizes: nearest codes of the new blocks, not bit-exact).

State and checkpoints
---------------------
Live ``optimizer.state[p]`` of an 8-bit param: ``step`` (float32 0-d tensor), ``exp_avg`` /
``exp_avg_sq`` (uint8, the local param's shape), ``exp_avg_absmax`` / ``exp_avg_sq_absmax``
(float32, ceil(numel / block_size)), plus ``master`` / ``master_remainder`` as ``mpfused.AdamW``.

Saved format, version 2 (``FORMAT_VERSION``): ``state_dict()`` stores an 8-bit param's state
under bitsandbytes' key names, so that no uint8 codes sit under torch's ``exp_avg`` /
``exp_avg_sq`` (``torch.optim.AdamW.load_state_dict`` would cast them to float and train on
them): ``step``, ``state1`` / ``state2`` (uint8 codes of exp_avg / exp_avg_sq), ``absmax1`` /
``absmax2`` (float32) and ``master`` or ``master_remainder`` when the param has one. A param
with fp32 state keeps torch's ``step``, ``exp_avg``, ``exp_avg_sq`` (+ master). The dict adds
``"mpfused_8bit": {"version", "signed_map", "unsigned_map"}``; ``block_size`` is a group
setting. Version 1 (codes under ``exp_avg`` / ``exp_avg_sq``, absmax under ``exp_avg_absmax``
/ ``exp_avg_sq_absmax``) still loads; ``optimizer.state_dict_version = 1`` makes
``state_dict()`` write it (DCP fills a template's keys, so loading a version-1 DCP checkpoint
needs a version-1 template).

``load_state_dict`` restores every tensor with its own dtype (never cast to the param's), from
any ``map_location``, and rejects a block size, shape, absmax length or moment pair (both
codes, or both float) that does not match, and ``amsgrad=True`` groups, naming the param and
the rule. It also accepts a ``torch.optim.AdamW``/``Adam`` state_dict (moments are quantized)
and a bitsandbytes ``AdamW8bit`` one (``state1``/``absmax1`` ...; 256-element blocks).
``to_torch_state_dict()`` returns a state_dict that ``torch.optim.AdamW`` (``Adam`` for
``Adam8bit``) loads, with dequantized fp32 moments (DTensors for DTensor params);
``from_torch_state_dict(sd)`` is ``load_state_dict(sd)``. ``to_bitsandbytes_state_dict()``
returns one that ``bitsandbytes.optim.AdamW8bit`` loads.

FSDP2 / DCP: the live codes and absmax of a DTensor param are per local shard (plain tensors,
blocks of the local shard). ``state_dict()`` gives them in the unsharded layout, so a DCP
checkpoint has this format's keys, dtypes and global shapes on any number of ranks: codes as a
uint8 DTensor with the param's placements, absmax as a float32 DTensor of ceil(numel /
block_size) entries (the whole param's blocks, ``Shard(0)`` where the param is sharded).
Block-aligned shards (each rank's blocks are whole-param blocks, see ``_aligned``) are saved and
loaded as views: exact, no collective. Otherwise saving re-blocks (dequantize, MAX-all-reduce
of the whole-param block absmax, re-encode to the nearest codes) and a load re-quantizes per
local shard: not bit-exact, and ``state_dict()`` / ``load_state_dict`` are then collectives (all
ranks call them, as ``get_state_dict`` / ``set_state_dict`` do). A per-rank (plain, local layout)
state_dict of earlier versions still loads on the same layout.

Scaler contract and clipping are ``mpfused.AdamW``'s: ``grad_scale``/``found_inf``/
``grad_norm_sq`` are read on device, a step with found_inf > 0 changes nothing (step counters
included), ``max_grad_norm`` fuses clipping. bitsandbytes' legacy constructor arguments
(``optim_bits``, ``args``, ``percentile_clipping``, ``block_wise``, ``is_paged``, ``max_unorm``,
``skip_zeros``) are accepted and ignored (a warning when set to a non-default value);
``amsgrad=True`` raises ValueError, as in bitsandbytes.
"""
from __future__ import annotations

import sys
import warnings
import weakref

import torch

from mpfused.distributed import all_reduce_, is_dtensor, mesh_groups
from mpfused.ops import adam8bit as adam8bit_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._buckets import Bucket, GroupPlan, build_buckets
from mpfused.optim.adamw import AdamW, _local
from mpfused.quant_maps import (SIGNED_ZERO_CODE, dequantize_blockwise, encode, inv_scale,
                                num_blocks, quantize_blockwise, signed_map, unsigned_map,
                                zero_code)

__all__ = ["AdamW8bit", "Adam8bit", "keep_32bit_state", "BLOCK_SIZES", "FORMAT_VERSION"]

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' CUDA set
FORMAT_VERSION = 2  # 2: 8-bit entries saved under bitsandbytes' keys (state1, absmax1, ...)
_BNB_BLOCK = 256  # bitsandbytes >= 0.44
_LEGACY = {"optim_bits": 32, "args": None, "percentile_clipping": 100, "block_wise": True,
           "is_paged": False, "max_unorm": 0.0, "skip_zeros": False}
_8BIT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
_BNB_KEYS = {"state1": "exp_avg", "state2": "exp_avg_sq", "absmax1": "exp_avg_absmax",
             "absmax2": "exp_avg_sq_absmax"}
_SAVED_KEYS = {key: bnb_key for bnb_key, key in _BNB_KEYS.items()}  # live -> saved (version 2)
_TORCH_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                     "capturable", "differentiable", "fused")

# ---- per-param 32-bit override ---------------------------------------------------------------
_KEEP32_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_OVERRIDES = [0]  # bumped on every registration: cached kernel plans are rebuilt


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
    is not seen until the plan is rebuilt for another reason."""
    mng = _bnb_manager()
    if mng is None:
        return (_OVERRIDES[0],)
    return (_OVERRIDES[0], len(getattr(mng, "pid2config", ())),
            len(getattr(mng, "module_weight_config_triple", ())))


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


class AdamW8bit(AdamW):
    _quantized_moments = True  # exp_avg/exp_avg_sq may be uint8 codes in a state_dict
    state_dict_version = FORMAT_VERSION  # 1: state_dict() writes version-1 keys (see above)

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 block_size: int = 256, min_8bit_size: int = 4096, master_weights: str = "fp32",
                 max_grad_norm: float | None = None, maximize: bool = False,
                 capturable: bool = False, backend: str | None = None, seed: int = 0,
                 foreach=None, fused=None, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None, **legacy):
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True "
                             "(as bitsandbytes); use mpfused.AdamW")
        unknown = set(legacy) - set(_LEGACY)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments "
                            f"{sorted(unknown)}")
        for key, value in legacy.items():
            if value != _LEGACY[key] and not (key == "optim_bits" and value == 8):
                warnings.warn(f"{type(self).__name__}: {key}={value!r} is a legacy "
                              "bitsandbytes argument and is ignored", stacklevel=2)
        # Read by add_param_group, which super().__init__ calls.
        self._8bit_defaults = dict(block_size=block_size, min_8bit_size=min_8bit_size,
                                   optim_bits=8)
        _check_group_8bit(self._8bit_defaults, f"mpfused.{type(self).__name__}:")
        super().__init__(params, lr, betas, eps, weight_decay, False, maximize=maximize,
                         capturable=capturable, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, backend=backend, seed=seed,
                         foreach=foreach, fused=fused, differentiable=differentiable,
                         decoupled_weight_decay=decoupled_weight_decay)
        self.defaults.update(self._8bit_defaults)

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, value in self._8bit_defaults.items():
            group.setdefault(key, value)
        try:
            _check_group_8bit(group)
        except ValueError as e:
            self.param_groups.pop()  # nothing of the rejected group stays (as AdamW's checks)
            raise ValueError(f"mpfused.{type(self).__name__}: {e}") from None

    _PICKLED = {**AdamW._PICKLED,
                "_8bit_defaults": dict(block_size=256, min_8bit_size=4096, optim_bits=8)}

    def _register_hooks(self) -> None:
        super()._register_hooks()
        self.register_state_dict_post_hook(_add_format)
        self.register_load_state_dict_pre_hook(_check_and_stash_8bit, prepend=True)
        self.register_load_state_dict_post_hook(_restore_8bit)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("block_size", 256)
            group.setdefault("min_8bit_size", 4096)
            group.setdefault("optim_bits", 8)

    # ---- which params are 8-bit --------------------------------------------------------------
    def _wants_8bit(self, group, p, kept: set[int]) -> bool:
        return (group["optim_bits"] == 8 and p.numel() >= group["min_8bit_size"]  # global numel
                and getattr(p, "_mpfused_optim_bits", 8) != 32 and id(p) not in kept)

    @staticmethod
    def _is_8bit_state(state) -> bool:
        return "exp_avg" in state and state["exp_avg"].dtype == torch.uint8

    def _init_state(self, group, p, want_8bit: bool = False) -> None:
        state = self.state[p]
        if len(state) != 0:
            return
        if not want_8bit:
            return super()._init_state(group, p)  # step, fp32 moments
        self._master_mode(group, p)  # an invalid mode for this dtype fails before any state
        local = _local(p)
        blocks = num_blocks(local.numel(), group["block_size"])
        state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        state["exp_avg"] = torch.full(local.shape, SIGNED_ZERO_CODE, dtype=torch.uint8,
                                      device=local.device)  # codes of exact zeros
        state["exp_avg_sq"] = torch.zeros(local.shape, dtype=torch.uint8, device=local.device)
        state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        state["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        # The codes and absmax are per local shard (blocks never straddle shards); masters come
        # from AdamW._sync_state_keys, from p (a DTensor param gets DTensor masters).

    def _convert_state(self, group, p, to_8bit: bool, block: int | None = None) -> None:
        """Quantize fp32 moments (to_8bit) or dequantize codes, in place in self.state[p], with
        blocks of `block` (default: the group's)."""
        state, block = self.state[p], block or group["block_size"]
        local = _local(p)
        if to_8bit:
            for key, qmap, absmax_key in (("exp_avg", signed_map(local.device), "exp_avg_absmax"),
                                          ("exp_avg_sq", unsigned_map(local.device),
                                           "exp_avg_sq_absmax")):
                codes, absmax = quantize_blockwise(_local(state[key]), qmap, block)
                state[key], state[absmax_key] = codes.contiguous(), absmax
        else:
            state["exp_avg"] = dequantize_blockwise(state["exp_avg"], state.pop("exp_avg_absmax"),
                                                    signed_map(local.device), block)
            state["exp_avg_sq"] = dequantize_blockwise(
                state["exp_avg_sq"], state.pop("exp_avg_sq_absmax"), unsigned_map(local.device),
                block)

    def _adopt_written_state(self, p) -> None:
        """AdamW's, and moments written as floats over 8-bit state (a reset of one or both): a
        moment still in codes is dequantized and the absmax go, so _sync_form sees one form."""
        state = self.state[p]
        floats = [k for k in ("exp_avg", "exp_avg_sq")
                  if isinstance(state.get(k), torch.Tensor) and state[k].is_floating_point()]
        if floats and "exp_avg_absmax" in state:
            block = _state_block_size(state, _local(p).numel(), 256)
            for key, qmap in (("exp_avg", signed_map), ("exp_avg_sq", unsigned_map)):
                absmax = state.pop(f"{key}_absmax", None)
                if key not in floats and absmax is not None:
                    state[key] = dequantize_blockwise(state[key], absmax, qmap(_local(p).device),
                                                      block)
        super()._adopt_written_state(p)

    def _sync_form(self, group, p, want_8bit: bool) -> None:
        """Bring p's state to the form its group wants: 8-bit or fp32, and 8-bit in blocks of the
        group's block_size (after a change of it: dequantize with the old blocks, re-quantize)."""
        state = self.state[p]
        if "exp_avg" not in state:
            return
        if self._is_8bit_state(state):
            old = _state_block_size(state, _local(p).numel(), group["block_size"])
            if want_8bit and old == group["block_size"]:
                return
            self._convert_state(group, p, to_8bit=False, block=old)
        if want_8bit:
            self._convert_state(group, p, to_8bit=True)

    # ---- kernel plan: 8-bit and fp32-state params in separate buckets ---------------------------
    def _plan(self, index: int, group, grads, cache: bool = True) -> GroupPlan:
        params = group["params"]
        extra = (group["master_weights"], group["optim_bits"], group["block_size"],
                 group["min_8bit_size"], _overrides_epoch())
        plan = self._plans.get(index) if cache else None
        if plan is not None and plan.matches(params, grads, extra):
            return plan
        try:  # settings may have been changed in the group since add_param_group
            _check_group_8bit(group, f"param_groups[{index}]")
        except ValueError as e:
            raise ValueError(f"mpfused.{type(self).__name__}: {e}") from None
        kept = _kept_32bit_ids()
        buckets = []
        for b in build_buckets(params, grads):
            split: dict[bool, Bucket] = {}
            for i, p in zip(b.indices, b.params):
                want = self._wants_8bit(group, p, kept)
                self._init_state(group, p, want)
                self._adopt_written_state(p)
                self._sync_form(group, p, want)
                sub = split.setdefault(want, Bucket(indices=[], params=[]))
                sub.indices.append(i)
                sub.params.append(p)
            # fp32-state (small) params first: the 8-bit bucket's pass over memory evicts the
            # host-side code and data the next call needs (the small call costs 40 us after it,
            # 20 us warm, on the 2-core CPU).
            for want, sub in sorted(split.items(), key=lambda kv: kv[0]):
                self._fill_bucket(group, sub, want)
                buckets.append(sub)
        plan = GroupPlan.of(params, grads, extra, buckets)
        if cache:
            self._plans[index] = plan
        return plan

    def _fill_bucket(self, group, b: Bucket, eight: bool = False) -> None:
        super()._fill_bucket(group, b)
        b.state["eight"] = eight
        if eight:
            st = [self.state[p] for p in b.params]
            dev = b.state["local_params"][0].device
            b.state.update(absmax1s=[s["exp_avg_absmax"] for s in st],
                           absmax2s=[s["exp_avg_sq_absmax"] for s in st],
                           qmap1=signed_map(dev), qmap2=unsigned_map(dev))
            s = b.state
            s["step_"] = BoundOp(adam8bit_ops.adam8bit_step_, [
                s["local_params"], s["exp_avgs"], s["exp_avg_sqs"], s["absmax1s"], s["absmax2s"],
                s["masters"], s["steps"]], s["param_ids"], s["elem_offsets"])

    # ---- step: AdamW.step, with 8-bit buckets launched on the 8-bit kernel ----------------------
    def _launch(self, b, grads, group, hyper, scaling) -> None:
        s = b.state
        if not s["eight"]:
            return super()._launch(b, grads, group, hyper, scaling)
        s["step_"](grads, s["qmap1"], s["qmap2"], int(group["block_size"]), *hyper,
                   bool(group["maximize"]), bool(group["decoupled_weight_decay"]), s["mode"],
                   *scaling, backend=self._backend)

    # ---- conversions -------------------------------------------------------------------------
    def to_torch_state_dict(self) -> dict:
        """A state_dict for ``torch.optim.AdamW`` (``torch.optim.Adam`` for ``Adam8bit``):
        fp32 moments (8-bit ones dequantized), the step counters, torch's group keys. fp32
        masters have no place in a torch state_dict and are dropped."""
        self._local_8bit_state_dict = True  # the local codes are dequantized below
        try:
            sd = self.state_dict()
        finally:
            del self._local_8bit_state_dict
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        groups_of = {i: g for g in self.param_groups for i in [id(q) for q in g["params"]]}
        state = {}
        for pid, p in zip(ids, params):
            saved = sd["state"].get(pid)
            if not saved:
                continue
            saved = _saved_8bit(saved)  # the live key names
            out = {"step": saved["step"].detach().float().reshape(()).cpu().clone()}  # no alias
            block = groups_of[id(p)]["block_size"]
            for key, qmap, absmax_key in (("exp_avg", signed_map, "exp_avg_absmax"),
                                          ("exp_avg_sq", unsigned_map, "exp_avg_sq_absmax")):
                v = saved[key]
                if v.dtype == torch.uint8:  # local codes: a DTensor param gets a DTensor moment
                    m = dequantize_blockwise(_local(v), _local(saved[absmax_key]),
                                             qmap(_local(v).device), block)
                    out[key] = _like_param(m, p)
                else:
                    out[key] = v.detach().clone().float()
            state[pid] = out
        groups = []
        for g in sd["param_groups"]:
            tg = {k: g[k] for k in _TORCH_GROUP_KEYS if k in g}
            tg.update(amsgrad=False, decoupled_weight_decay=bool(g["decoupled_weight_decay"]),
                      params=g["params"])
            if "param_names" in g:
                tg["param_names"] = g["param_names"]
            groups.append(tg)
        return {"state": state, "param_groups": groups}

    def to_bitsandbytes_state_dict(self) -> dict:
        """A state_dict that ``bitsandbytes.optim.AdamW8bit`` (``Adam8bit`` for weight_decay=0)
        over the same params and groups loads: per param ``step`` (int), ``state1`` /
        ``state2`` with ``qmap1`` / ``qmap2`` and ``absmax1`` / ``absmax2`` for 8-bit params
        (uint8 codes), fp32 ``state1`` / ``state2`` otherwise; groups with bitsandbytes' keys.
        bitsandbytes' blocks are 256 elements: a group with another block_size is re-quantized
        (nearest codes of the new blocks, not bit-exact). Masters are dropped (bitsandbytes
        has none) and bitsandbytes decides nothing from min_8bit_size once state exists."""
        state, groups, index = {}, [], 0
        for gi, group in enumerate(self.param_groups):
            if any(is_dtensor(p) for p in group["params"]):
                raise NotImplementedError(
                    f"to_bitsandbytes_state_dict: param group {gi} has DTensor params; "
                    "bitsandbytes' optimizers take plain tensors (use state_dict() with DCP)")
            if group["maximize"]:
                raise ValueError(f"to_bitsandbytes_state_dict: param group {gi} has "
                                 "maximize=True, which bitsandbytes does not support")
            if not group["decoupled_weight_decay"] and group["weight_decay"]:
                raise ValueError(
                    f"to_bitsandbytes_state_dict: param group {gi} has weight_decay="
                    f"{group['weight_decay']} with Adam's L2 decay; bitsandbytes' Adam8bit "
                    "decouples weight decay (AdamW), so its steps would differ")
            ids = []
            for p in group["params"]:
                ids.append(index)
                if self.state.get(p):
                    state[index] = self._bnb_entry(group, p, self.state[p])
                index += 1
            lr = group["lr"]
            groups.append({"lr": float(lr.item() if isinstance(lr, torch.Tensor) else lr),
                           "betas": tuple(float(b) for b in group["betas"]),
                           "eps": float(group["eps"]),
                           "weight_decay": float(group["weight_decay"]), "alpha": 0.0,
                           "t_alpha": None, "t_beta3": None, "params": ids})
        return {"state": state, "param_groups": groups}

    def _bnb_entry(self, group, p, st) -> dict:
        """One param's state in bitsandbytes' layout (new tensors: never the live ones)."""
        entry = {"step": int(st["step"].item())}
        if not self._is_8bit_state(st):
            entry.update(state1=st["exp_avg"].detach().float().clone(),
                         state2=st["exp_avg_sq"].detach().float().clone())
            return entry
        dev = st["exp_avg"].device
        # the live layout: it lags a block_size change until the next step converts it
        block = _state_block_size(st, p.numel(), group["block_size"])
        for n, key, qmap in ((1, "exp_avg", signed_map(dev)), (2, "exp_avg_sq", unsigned_map(dev))):
            codes, absmax = st[key], st[key + "_absmax"]
            if block != _BNB_BLOCK:
                codes, absmax = quantize_blockwise(
                    dequantize_blockwise(codes, absmax, qmap, block), qmap, _BNB_BLOCK)
            entry.update({f"state{n}": codes.clone(), f"absmax{n}": absmax.clone(),
                          f"qmap{n}": qmap.clone()})
        return entry

    def from_torch_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim.AdamW``/``Adam`` (or mpfused, or bitsandbytes 8-bit)
        state_dict: the same as ``load_state_dict``, which quantizes fp32 moments as needed."""
        self.load_state_dict(state_dict)


class Adam8bit(AdamW8bit):
    """``torch.optim.Adam`` semantics with 8-bit state: L2 weight decay added to the gradient,
    default 0. bitsandbytes' Adam8bit decouples weight decay (acts as AdamW8bit): pass
    ``decoupled_weight_decay=True`` for its behaviour."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


# ---- FSDP2 / DCP: the global block layout ----------------------------------------------------
# The live 8-bit state of a DTensor param is per local shard: plain uint8 codes of the local
# shape, one absmax per block of the local shard (row-major). In state_dict() it takes the
# layout of the unsharded param instead, so that a checkpoint has the same keys, dtypes and
# global shapes on any number of ranks, 1 (the non-distributed format) included:
#   codes  -> uint8 DTensor with the param's mesh, placements, shape and stride;
#   absmax -> float32 DTensor of ceil(numel / block_size) entries, the blocks of the whole param
#             (its row-major order), Shard(0) on the mesh dims that shard the param.
# Aligned case (_aligned: every rank's local blocks are blocks of the whole param, and the ones
# its absmax chunk holds): both are views of the live tensors, exact, no collective. FSDP2
# (dim-0 shards) with every shard's numel a multiple of block_size and evenly split blocks is.
# Otherwise state_dict() re-blocks: each rank dequantizes its shard, the absmax of every global
# block is MAX-all-reduced over the mesh and each rank re-encodes its elements with it (the
# codes of bitsandbytes' encoder applied to the unsharded dequantized state); a load into a
# layout that is not aligned dequantizes with the global absmax and re-quantizes per local
# shard. Both round to the nearest codes of the new blocks (not bit-exact); every rank decides
# alike from global facts, so the collectives match.
def _local_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of chunk i of n items cut in `parts` (torch.chunk / DTensor Shard semantics)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return lo, min(lo + size, n)


def _plain_shard(pl) -> bool:
    from torch.distributed.tensor import Shard

    return type(pl) is Shard  # noqa: E721  (not _StridedShard or other subclasses)


def _absmax_placements(p) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Replicate() if pl.is_replicate() else Shard(0) for pl in p.placements)


def _aligned(p, block: int) -> bool:
    """Whether, on every rank, the local shard's blocks are blocks of the whole param and are
    exactly the absmax entries that rank holds under ``_absmax_placements`` (decided from the
    param's global shape, mesh and placements only: the same answer on every rank)."""
    dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if not dims:
        return True  # replicated: local = global
    if len(dims) != 1 or not _plain_shard(p.placements[dims[0]]) or p.placements[dims[0]].dim:
        return False
    parts, rows, numel = p.device_mesh.size(dims[0]), p.shape[0], p.numel()
    inner = numel // rows if rows else 0
    nb = num_blocks(numel, block)
    for i in range(parts):
        r0, r1 = _local_range(rows, parts, i)
        e0, e1 = r0 * inner, r1 * inner
        lo, hi = _local_range(nb, parts, i)
        if e1 == e0:
            if hi != lo:
                return False
            continue
        if e0 % block or (e1 != numel and e1 % block) or \
                (e0 // block, num_blocks(e1, block)) != (lo, hi):
            return False
    return True


def _global_block_index(p, block: int) -> torch.Tensor:
    """int64 tensor of the local shard's shape: the index of each local element's block in the
    unsharded param's (row-major) block layout."""
    if not all(pl.is_replicate() or _plain_shard(pl) for pl in p.placements):
        raise NotImplementedError(
            f"mpfused.AdamW8bit: the 8-bit state of a DTensor param with placements "
            f"{tuple(p.placements)} can only be checkpointed when its shards are block-aligned "
            "(see mpfused.distributed); Shard and Replicate placements are supported")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = _local(p)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"mpfused.AdamW8bit: local shard shape {tuple(local.shape)} differs "
                           f"from its DTensor layout {tuple(shape)}")
    idx = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = shape[d]
        idx = idx + ((torch.arange(shape[d], device=local.device) + offset[d]) * stride).view(view)
        stride *= p.shape[d]
    return (idx.expand(tuple(shape)) // block).contiguous()


def _encode_scaled(values: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """quantize_blockwise's encoding with a given absmax per element (uint8, values' shape)."""
    flat = values.reshape(-1).float()
    codes = encode(flat * inv_scale(absmax.reshape(-1)), qmap)
    zero = zero_code(qmap)
    if zero > 0:  # bitsandbytes' sign rule, as quantize_blockwise
        codes = torch.where(torch.signbit(flat) & (codes == zero), codes - 1, codes)
    return codes.to(torch.uint8).reshape(values.shape)


def _like_param(t: torch.Tensor, p):
    """A local per-element tensor as p: a DTensor with p's layout when p is one."""
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _to_global(p, codes, absmax, qmap, block):
    """Local codes/absmax of DTensor param p -> (codes, absmax) DTensors of the global layout."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, nb = p.device_mesh, num_blocks(p.numel(), block)
    placements = _absmax_placements(p)
    if _aligned(p, block):
        gabs = DTensor.from_local(absmax, mesh, placements, run_check=False, shape=(nb,),
                                  stride=(1,))
        return _like_param(codes, p), gabs
    idx = _global_block_index(p, block)  # collective below: every rank gets here together
    values = dequantize_blockwise(codes, absmax, qmap, block)
    full = torch.zeros(nb, dtype=torch.float32, device=values.device)
    full.scatter_reduce_(0, idx.reshape(-1), values.abs().reshape(-1), "amax")
    all_reduce_(full, mesh_groups(p), "max")
    codes = _encode_scaled(values, full[idx], qmap)
    gabs = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=(nb,), stride=(1,)).redistribute(mesh, placements)
    return _like_param(codes, p), gabs


def _from_global(p, codes, absmax, qmap, block):
    """Loaded (codes, absmax) of param p -> local codes and absmax of the local blocks. Plain
    ones are taken as they are (the local layout: a per-rank or non-distributed state_dict)."""
    if not is_dtensor(p):  # DTensor state for a plain param: gather it
        return (codes.full_tensor() if is_dtensor(codes) else codes,
                absmax.full_tensor() if is_dtensor(absmax) else absmax)
    if is_dtensor(codes) and (codes.device_mesh != p.device_mesh
                              or tuple(codes.placements) != tuple(p.placements)):
        codes = codes.redistribute(p.device_mesh, p.placements)
    local_codes = _local(codes)
    if not is_dtensor(absmax):
        return local_codes, absmax
    if (_aligned(p, block) and absmax.device_mesh == p.device_mesh
            and tuple(absmax.placements) == _absmax_placements(p)):
        return local_codes, absmax.to_local()
    full = absmax.full_tensor()  # collective: every rank takes this branch together
    idx = _global_block_index(p, block)
    values = qmap.to(local_codes.device)[local_codes.long()] * full.to(local_codes.device)[idx]
    return quantize_blockwise(values, qmap.to(local_codes.device), block)


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
        if version == 2 and saved and AdamW8bit._is_8bit_state(saved):
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
        if not saved or not is_dtensor(p) or not AdamW8bit._is_8bit_state(saved):
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
