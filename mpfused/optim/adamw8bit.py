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

import warnings

import torch

from mpfused.optim._checkpoint_8bit import BLOCK_SIZES, FORMAT_VERSION, _check_group_8bit
from mpfused.optim._overrides import keep_32bit_state
from mpfused.optim.adamw import AdamW
from mpfused.optim.state8bit import State8bit

__all__ = ["AdamW8bit", "Adam8bit", "keep_32bit_state", "BLOCK_SIZES", "FORMAT_VERSION"]

_LEGACY = {"optim_bits": 32, "args": None, "percentile_clipping": 100, "block_wise": True,
           "is_paged": False, "max_unorm": 0.0, "skip_zeros": False}


class AdamW8bit(State8bit, AdamW):
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

    _PICKLED = {**AdamW._PICKLED,
                "_8bit_defaults": dict(block_size=256, min_8bit_size=4096, optim_bits=8)}


class Adam8bit(AdamW8bit):
    """``torch.optim.Adam`` semantics with 8-bit state: L2 weight decay added to the gradient,
    default 0. bitsandbytes' Adam8bit decouples weight decay (acts as AdamW8bit): pass
    ``decoupled_weight_decay=True`` for its behaviour."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
