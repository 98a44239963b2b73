"""8-bit block-wise optimizer state, an engine feature: ``State8bit``, the mixin that gives an
optimizer on the engine bitsandbytes' 8-bit state for the state keys it names. It goes before the
32-bit optimizer in the bases (``class AdamW8bit(State8bit, AdamW)``, ``SGD8bit(State8bit,
SGD)``, ``Lion8bit(State8bit, Lion)``); the 8-bit class says only which state keys are codes into
which map (``_QUANT_STATES``, bitsandbytes' order), its 8-bit op and the flags that op takes
after the scalars (``_OP_8BIT``, ``_flags_8bit``), its group rules (``_check_group_rules``) and
how its groups read in torch's and bitsandbytes' state_dicts (``_TORCH_GROUP_KEYS``,
``_torch_group``, ``_bnb_group``; the engine's ``_adopt_saved_group``). The width is
``_STATE_BITS`` (8, or 4: torchao's 4-bit format); a 4-bit optimizer whose 8-bit class exists is
that class with ``_STATE_BITS = 4`` and its op (``class SGD4bit(SGD8bit)``, ``Lion4bit(Lion8bit)``).

Encoding (csrc/include/mpfused/quant8_math.h, mpfused/quant_maps.py)
--------------------------------------------------------------------
* A quantized state is stored as uint8 codes into bitsandbytes' signed dynamic map (a first
  moment or momentum) or its unsigned map (a second moment) (``create_dynamic_map``, byte-equal
  to bnb's; 256 sorted float32 values, exact 0 at code 127 / 0, max 1.0).
* Each state tensor is cut into blocks of ``block_size`` consecutive elements (row-major order of
  the param; the last block may be short) with one float32 ``absmax`` per block:
  ``value = map[code] * absmax[block]``.
* A step dequantizes with the old absmax, updates in float32 exactly like the 32-bit optimizer,
  updates the param with the unquantized new state, takes each block's new absmax from it and
  stores ``code = nearest map entry to m * (1/absmax)`` (ties to the lower code; the decision is
  exact). bitsandbytes' sign rule: a negative signed state that rounds to 0 is stored one code
  below 0, so it never comes back as 0 or positive.

Which params get 8-bit state
----------------------------
Params with fewer than ``min_8bit_size`` elements (default 4096, judged on the whole logical
param, also for DTensors) keep fp32 state and take the 32-bit optimizer's kernel, as do params of
a group with ``optim_bits=32``, params registered with ``keep_32bit_state(module_or_params)``
(e.g. embeddings) and, when bitsandbytes is already imported, params that its
``GlobalOptimManager`` keeps at ``optim_bits=32`` (``override_config(p, "optim_bits", 32)`` or
``register_module_override(module, "weight", {"optim_bits": 32})``, which
``bnb.nn.StableEmbedding`` / ``bnb.nn.Embedding`` call themselves). A change of these settings,
or of a group's ``block_size``, converts the existing state at the next step (a new block size
re-quantizes: nearest codes of the new blocks, not bit-exact). A bucket of 8-bit params and one
of fp32-state params are two kernel calls.

State and checkpoints (mpfused/optim/_checkpoint_8bit.py)
---------------------------------------------------------
Live ``optimizer.state[p]`` of an 8-bit param: ``step`` (float32 0-d tensor), each quantized
``key`` as uint8 codes of the local param's shape with ``{key}_absmax`` (float32,
ceil(numel / block_size)), the optimizer's other state, ``master`` / ``master_remainder`` as
the 32-bit optimizer.

Saved format, version 2 (``FORMAT_VERSION``): ``state_dict()`` stores an 8-bit param's codes
under bitsandbytes' key names, so that no uint8 codes sit under torch's keys (torch's
``load_state_dict`` would cast them to float and train on them): the n-th quantized state as
``state{n}`` (codes) and ``absmax{n}`` (float32), plus ``step`` and the masters. A param with
fp32 state keeps torch's keys. The dict adds ``"mpfused_8bit": {"version", "signed_map",
"unsigned_map"}``; ``block_size`` is a group setting. Version 1 (codes under the live keys, absmax
under ``{key}_absmax``) still loads; ``optimizer.state_dict_version = 1`` makes ``state_dict()``
write it (DCP fills a template's keys, so loading a version-1 DCP checkpoint needs a version-1
template).

``load_state_dict`` restores every tensor with its own dtype (never cast to the param's), from
any ``map_location``, and rejects a block size, shape, absmax length or a state that is partly
codes, partly floats, naming the param and the rule. It also accepts the 32-bit torch
optimizer's state_dict (states are quantized) and bitsandbytes' 8-bit one (``state1`` /
``absmax1`` ...; 256-element blocks). ``to_torch_state_dict()`` returns the 32-bit optimizer's
state_dict with dequantized fp32 state (DTensors for DTensor params); ``from_torch_state_dict(sd)``
is ``load_state_dict(sd)``. ``to_bitsandbytes_state_dict()`` returns one that bitsandbytes'
8-bit optimizer loads (masters dropped: bitsandbytes has none).

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

Scaler contract and clipping are the engine's: ``grad_scale``/``found_inf``/``grad_norm_sq`` are
read on device, a step with found_inf > 0 changes nothing (step counters included),
``max_grad_norm`` fuses clipping. bitsandbytes' legacy constructor arguments (``optim_bits``,
``args``, ``percentile_clipping``, ``block_wise``, ``is_paged``, ``max_unorm``, ``skip_zeros``)
are accepted and ignored (a warning when set to a non-default value).
"""
from __future__ import annotations

import warnings

import torch

from mpfused.ops.bound import BoundOp
from mpfused.optim._buckets import Bucket, GroupPlan, build_buckets
from mpfused.optim._checkpoint_8bit import (_GROUP_KEYS_8BIT, FORMAT_VERSION, _add_format,
                                            _check_and_stash_8bit, _restore_8bit,
                                            check_settings_8bit, is_8bit_state, is_codes,
                                            live_block_size, parse_quant_states,
                                            to_bitsandbytes_state_dict, to_torch_state_dict)
from mpfused.optim._overrides import _kept_32bit_ids, _overrides_epoch
from mpfused.optim.engine import _local
from mpfused.quant_maps import DEFAULT_BLOCK_SIZE

__all__ = ["State8bit"]

_LEGACY = {"optim_bits": 32, "args": None, "percentile_clipping": 100, "block_wise": True,
           "is_paged": False, "max_unorm": 0.0, "skip_zeros": False}
# A constructor's block_size=None (the default of every 8-bit and 4-bit class): the format's
# blocks, quant_maps.DEFAULT_BLOCK_SIZE (bitsandbytes' 256, torchao's 4-bit 128).
_DEFAULTS_8BIT = dict(block_size=DEFAULT_BLOCK_SIZE[8], min_8bit_size=4096, optim_bits=8)


class State8bit:
    """8-bit block-wise state for the engine's optimizers (a mixin: see the module docstring)."""
    _QUANT_STATES: tuple = ()  # ((state key, "signed" | "unsigned"), ...), bitsandbytes' order
    _OP_8BIT = None  # an Op: (params, grads, *codes, *absmaxs, masters, steps, *qmaps, *, ...)
    _TORCH_GROUP_KEYS: tuple = ()  # the 32-bit torch optimizer's group keys; (): all but 8-bit
    state_dict_version = FORMAT_VERSION  # 1: state_dict() writes version-1 keys (see above)
    _STATE_BITS = 8  # 4: the 4-bit codec (mpfused/quant4.py; AdamW4bit), same machinery

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._quant = parse_quant_states(cls._QUANT_STATES, cls._STATE_BITS)

    def _setup_8bit(self, block_size: int | None, min_8bit_size: int, legacy: dict) -> None:
        """Called before the 32-bit optimizer's __init__: the 8-bit group defaults that
        add_param_group reads (``block_size=None``: the format's, ``DEFAULT_BLOCK_SIZE``), and
        bitsandbytes' legacy arguments (accepted and ignored by the 8-bit format only)."""
        name = type(self).__name__
        if block_size is None:
            block_size = DEFAULT_BLOCK_SIZE[self._STATE_BITS]
        unknown = set(legacy) - set(_LEGACY if self._STATE_BITS == 8 else ())
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")
        for key, value in legacy.items():
            if value != _LEGACY[key] and not (key == "optim_bits" and value == self._STATE_BITS):
                warnings.warn(f"{name}: {key}={value!r} is a legacy bitsandbytes argument and "
                              "is ignored", stacklevel=3)
        self._8bit_defaults = dict(block_size=block_size, min_8bit_size=min_8bit_size,
                                   optim_bits=self._STATE_BITS)
        check_settings_8bit(self._8bit_defaults, f"mpfused.{name}:", self._STATE_BITS)

    def _setup_engine(self, *args) -> None:
        super()._setup_engine(*args)
        self.defaults.update(self._8bit_defaults)

    def _check_new_group(self, group) -> None:
        super()._check_new_group(group)
        for key, value in self._8bit_defaults.items():
            group.setdefault(key, value)
        self._check_group_8bit(group)

    def _check_group_8bit(self, group, where: str = "param group") -> None:
        check_settings_8bit(group, where, self._STATE_BITS)
        self._check_group_rules(group, where)

    def _register_hooks(self) -> None:
        super()._register_hooks()
        self.register_state_dict_post_hook(_add_format)
        self.register_load_state_dict_pre_hook(_check_and_stash_8bit, prepend=True)
        self.register_load_state_dict_post_hook(_restore_8bit)

    def __getstate__(self):
        state = super().__getstate__()
        state["_8bit_defaults"] = self._8bit_defaults
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        defaults = dict(_DEFAULTS_8BIT, optim_bits=self._STATE_BITS)
        self.__dict__.setdefault("_8bit_defaults", defaults)
        for group in self.param_groups:
            for key, value in defaults.items():
                group.setdefault(key, value)

    # ---- what an 8-bit optimizer provides -----------------------------------------------------
    def _check_group_rules(self, group, where: str) -> None:
        """The optimizer's own rules for a group (e.g. no amsgrad); ValueError naming `where`."""

    def _flags_8bit(self, group) -> dict:
        """The 8-bit op's keyword arguments between the scalars and master_mode (required of
        every 8-bit class: AdamW8bit, SGD8bit, Lion8bit define it)."""
        raise NotImplementedError(f"{type(self).__name__} must define _flags_8bit")

    def _torch_group(self, g) -> dict:
        """A saved group as the 32-bit optimizer's state_dict holds it."""
        keep = self._TORCH_GROUP_KEYS
        tg = {k: v for k, v in g.items() if (k in keep if keep else k not in _GROUP_KEYS_8BIT)}
        tg["params"] = g["params"]
        if "param_names" in g:
            tg["param_names"] = g["param_names"]
        return tg

    def _bnb_group(self, gi, group) -> dict:
        """bitsandbytes' group keys but lr and params; ValueError for a setting it lacks."""
        raise NotImplementedError

    # ---- which params are 8-bit --------------------------------------------------------------
    def _wants_8bit(self, group, p, kept: set[int]) -> bool:
        return (group["optim_bits"] != 32 and p.numel() >= group["min_8bit_size"]  # global numel
                and getattr(p, "_mpfused_optim_bits", 8) != 32 and id(p) not in kept)

    def _is_8bit_state(self, state) -> bool:
        return is_8bit_state(state, self._quant)

    def _init_state(self, group, p, want_8bit: bool = False) -> None:
        if not want_8bit:
            return super()._init_state(group, p)  # the 32-bit optimizer's fp32 state
        self._start_state(group, p)
        # The codes come from _sync_form (exact zeros), per local shard (blocks never straddle
        # shards); masters from the engine's _sync_state_keys, from p (DTensor masters).

    def _convert_state(self, group, p, to_8bit: bool, block: int | None = None) -> None:
        """Quantize the fp32 states (to_8bit) or dequantize the codes, in place in
        self.state[p], with blocks of `block` (default: the group's)."""
        state, block, dev = self.state[p], block or group["block_size"], _local(p).device
        for q in self._quant:
            value = state.get(q.key)
            if to_8bit and isinstance(value, torch.Tensor) and value.is_floating_point():
                codes, absmax = q.quantize(_local(value).to(dev), block)
                state[q.key], state[q.absmax_key] = codes.contiguous(), absmax
            elif not to_8bit and is_codes(value):
                state[q.key] = q.dequantize(value, state.pop(q.absmax_key), block,
                                            _local(p).shape)

    def _adopt_written_state(self, p) -> None:
        """The 32-bit optimizer's, after states written as floats over 8-bit state (a reset of
        some): the states still in codes are dequantized and the absmax go, so _sync_form sees
        one form."""
        state = self.state[p]
        floats = [q for q in self._quant if isinstance(state.get(q.key), torch.Tensor)
                  and state[q.key].is_floating_point()]
        codes = [q for q in self._quant if is_codes(state.get(q.key)) and q.absmax_key in state]
        if floats and codes:
            block = live_block_size(state, codes, _local(p).numel())  # told by the absmax
            for q in codes:
                state[q.key] = q.dequantize(state[q.key], state.pop(q.absmax_key), block,
                                            _local(p).shape)
        for q in floats:
            state.pop(q.absmax_key, None)
        super()._adopt_written_state(p)

    def _sync_form(self, group, p, want_8bit: bool) -> None:
        """Bring p's state to the form its group wants: 8-bit or fp32, and 8-bit in blocks of the
        group's block_size (after a change of it: dequantize with the old blocks, re-quantize).
        A quantized state missing from an 8-bit param starts at exact zeros."""
        state, local = self.state[p], _local(p)
        block = group["block_size"]
        if self._is_8bit_state(state):
            old = live_block_size(state, self._quant, local.numel(), block)
            if want_8bit and old == block:
                return
            self._convert_state(group, p, to_8bit=False, block=old)
        if not want_8bit:
            return
        for q in self._quant:
            if q.key not in state:  # the 32-bit optimizer's zeros, without the fp32 tensor
                state[q.key], state[q.absmax_key] = q.zeros(local, block)
        self._convert_state(group, p, to_8bit=True)

    # ---- kernel plan: 8-bit and fp32-state params in separate buckets ---------------------------
    def _plan_options(self, group) -> tuple:
        return (*self._plan_extra(group), group["optim_bits"], group["block_size"],
                group["min_8bit_size"], _overrides_epoch())

    def _plan(self, index: int, group, grads, cache: bool = True) -> GroupPlan:
        params = group["params"]
        extra = self._plan_options(group)
        plan = self._plans.get(index) if cache else None
        if plan is not None and plan.matches(params, grads, extra):
            return plan
        try:  # settings may have been changed in the group since add_param_group
            self._check_group_8bit(group, f"param_groups[{index}]")
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
            s, dev = b.state, b.state["local_params"][0].device
            codes = [[_local(x[q.key]) for x in st] for q in self._quant]
            absmaxs = [[x[q.absmax_key] for x in st] for q in self._quant]
            s["qmaps"] = [q.qmap(dev) for q in self._quant]
            s["step_"] = BoundOp(self._OP_8BIT, [s["local_params"], *codes, *absmaxs,
                                                 s["masters"], s["steps"]],
                                 s["param_ids"], s["elem_offsets"])

    # ---- step: the 32-bit optimizer's, with 8-bit buckets launched on the 8-bit op -------------
    def _launch_args(self, b, group, hyper, scaling) -> tuple[tuple, dict]:
        s = b.state
        if not s["eight"]:
            return super()._launch_args(b, group, hyper, scaling)
        return tuple(s["qmaps"]), dict(hyper, block_size=int(group["block_size"]),
                                       **self._flags_8bit(group), master_mode=s["mode"],
                                       **scaling)

    # ---- conversions -------------------------------------------------------------------------
    def to_torch_state_dict(self) -> dict:
        """The 32-bit optimizer's state_dict (``torch.optim.AdamW`` / ``Adam`` / ``SGD``,
        ``mpfused.Lion``): fp32 state (8-bit codes dequantized), the step counters, its group
        keys. fp32 masters have no place in a torch state_dict and are dropped."""
        return to_torch_state_dict(self)

    def to_bitsandbytes_state_dict(self) -> dict:
        """A state_dict that bitsandbytes' 8-bit optimizer over the same params and groups loads:
        per param ``step`` (int), ``state{n}`` with ``qmap{n}`` and ``absmax{n}`` for 8-bit
        params (uint8 codes), fp32 ``state{n}`` otherwise; groups with bitsandbytes' keys.
        bitsandbytes' blocks are 256 elements: a group with another block_size is re-quantized
        (nearest codes of the new blocks, not bit-exact). Masters are dropped (bitsandbytes
        has none) and bitsandbytes decides nothing from min_8bit_size once state exists."""
        return to_bitsandbytes_state_dict(self)

    def from_torch_state_dict(self, state_dict: dict) -> None:
        """Load the 32-bit torch optimizer's (or mpfused's, or bitsandbytes') state_dict: the
        same as ``load_state_dict``, which quantizes fp32 state as needed."""
        self.load_state_dict(state_dict)
