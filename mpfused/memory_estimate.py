"""``mpfused.amp.estimate_memory``: the training-state bytes (weights, grads, master weights,
optimizer state) of a recipe, for a parameter count or a model."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from mpfused.fp32_islands import _HALF, _fp32_islands
from mpfused.quant4 import codes4_numel
from mpfused.quant_maps import DEFAULT_BLOCK_SIZE

# ---- estimate_memory -------------------------------------------------------------------------
# recipe -> (description, 16-bit weights?, master bytes per 16-bit param, 8-bit state?)
RECIPES = {
    "native": ("fp32 weights + autocast, fp32 moments (torch.amp)", False, 0, False),
    "master": ("16-bit weights + fp32 master + fp32 moments", True, 4, False),
    "remainder": ("bf16 weights + int16 remainder + fp32 moments", True, 2, False),
    "remainder8": ("bf16 weights + int8 correction (24-bit master) + fp32 moments", True, 1, False),
    "no-master": ("16-bit weights (stochastic rounding) + fp32 moments", True, 0, False),
    "8bit": ("16-bit weights + fp32 master + 8-bit moments", True, 4, True),
    "8bit-remainder": ("bf16 weights + int16 remainder + 8-bit moments", True, 2, True),
    "8bit-remainder8": ("bf16 weights + int8 correction (24-bit master) + 8-bit moments", True, 1,
                        True),
    "8bit-no-master": ("16-bit weights (stochastic rounding) + 8-bit moments", True, 0, True),
}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


@dataclass(frozen=True)
class MemoryEstimate:
    """Training-state bytes of one recipe (weights, grads, master weights, optimizer state)."""
    recipe: str
    description: str
    num_params: int
    weights: int
    grads: int
    master: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer_state

    @property
    def bytes_per_param(self) -> float:
        return self.total / max(self.num_params, 1)

    def per_param(self) -> dict:
        n = max(self.num_params, 1)
        return {k: getattr(self, k) / n for k in
                ("weights", "grads", "master", "optimizer_state", "total")}

    def __str__(self) -> str:
        rows = [f"recipe {self.recipe!r} ({self.description}), {self.num_params:,} params"]
        for key, value in self.per_param().items():
            label = key.replace("_", " ")
            rows.append(f"  {label:<16}{value:6.2f} B/param  {_fmt_bytes(getattr(self, key)):>12}")
        return "\n".join(rows)


# optimizer -> per-element state tensors (moments / buffers) it keeps
STATES = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1}


def _8bit_state_bytes(numel: int, block_size: int, states: int = 2, state_bits: int = 8) -> int:
    codes = numel if state_bits == 8 else codes4_numel(numel)  # 4-bit: two codes per byte
    return states * (codes + 4 * math.ceil(numel / block_size))


def estimate_memory(model_or_param_count, recipe: str = "master", *, keep_fp32=None,
                    block_size: int | None = None, min_8bit_size: int = 4096,
                    release: bool = False, optimizer: str = "adamw",
                    state_bits: int = 8) -> MemoryEstimate:
    """Bytes of weights, grads, master weights and optimizer state for a recipe (``RECIPES``):

    ===================  =======  =====  ======  =====  ====================
    recipe               weights  grads  master  state  total
    ===================  =======  =====  ======  =====  ====================
    ``native``           4        4      0       8      16
    ``master``           2        2      4       8      16
    ``remainder``        2        2      2       8      14
    ``remainder8``       2        2      1       8      13
    ``no-master``        2        2      0       8      12
    ``8bit``             2        2      4       2.03   ~10
    ``8bit-remainder``   2        2      2       2.03   ~8
    ``8bit-remainder8``  2        2      1       2.03   ~7 (~5 with release)
    ``8bit-no-master``   2        2      0       2.03   ~6
    ===================  =======  =====  ======  =====  ====================

    For a parameter count these are the per-parameter figures. For a model every parameter is
    counted once (tied weights too): fp32 islands (``keep_fp32``, as ``cast_model``; for a model
    already cast, its fp32 params) take 4 B weights and grads and no master; params with fewer
    than ``min_8bit_size`` elements keep fp32 moments in the 8-bit recipes; each param adds a
    4-byte step counter and each 8-bit state one fp32 absmax per ``block_size`` elements; frozen
    params count as weights only. Activations, autocast's cast cache, temporaries and allocator
    slack are not included.

    ``optimizer``: ``"adamw"`` / ``"adam"`` (two moments: the table), ``"sgd"`` (with momentum)
    or ``"lion"`` (one state tensor: half the state column, e.g. ``8bit-remainder`` with Lion is
    2 + 2 + 2 + 1.02 ~ 7 B/param).

    ``block_size=None``: the optimizers' default for the code width (256 for 8-bit, 128 for
    4-bit: ``quant_maps.DEFAULT_BLOCK_SIZE``).

    ``state_bits=4`` with an ``8bit*`` recipe: 4-bit moments (``mpfused.AdamW4bit``, 128-element
    blocks): 2 x (0.5 + 4 / 128) = 1.06 B/param of state, so ``8bit``
    becomes ~9.1, ``8bit-remainder`` ~7.1 and ``8bit-remainder-release`` ~5.1 B/param; with
    ``optimizer="sgd"`` / ``"lion"`` (``mpfused.SGD4bit`` / ``Lion4bit``) half that state.

    ``release=True`` (or a recipe name ending in ``-release``, e.g. ``"8bit-remainder-release"``):
    the step inside the backward (``mpfused.step_in_backward``) frees each grad as it is used, so
    no grad buffer is counted; during the backward at most two release buckets of grads
    (``bucket_bytes``, 4 MiB by default) and the largest grad are alive at once.
    """
    if recipe.endswith("-release"):
        recipe, release = recipe[:-len("-release")], True
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPES)} (optionally with '-release'), "
                         f"got {recipe!r}")
    if optimizer not in STATES:
        raise ValueError(f"optimizer must be one of {list(STATES)}, got {optimizer!r}")
    states = STATES[optimizer]
    if state_bits not in (4, 8):
        raise ValueError(f"state_bits must be 8 or 4, got {state_bits!r}")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE[state_bits]
    description, half, master_b, eight = RECIPES[recipe]
    if eight and state_bits == 4:
        description = description.replace("8-bit", "4-bit")
    if optimizer not in ("adamw", "adam"):
        description = description.replace("moments", f"{optimizer} state")
    if release:
        recipe, description = recipe + "-release", description + ", grads released in backward"
    w_b = 2 if half else 4
    if isinstance(model_or_param_count, nn.Module):
        est = _estimate_model(model_or_param_count, recipe.removesuffix("-release"), keep_fp32,
                              block_size, min_8bit_size, states, state_bits)
        return replace(est, recipe=recipe, description=description,
                       grads=0 if release else est.grads)
    n = int(model_or_param_count)
    state_b = states * ((state_bits / 8 + 4 / block_size) if eight else 4)
    return MemoryEstimate(recipe, description, n, w_b * n, 0 if release else w_b * n,
                          master_b * n, round(state_b * n))


def _estimate_model(model, recipe, keep_fp32, block_size, min_8bit_size,
                    states: int = 2, state_bits: int = 8) -> MemoryEstimate:
    description, half, master_b, eight = RECIPES[recipe]
    params, seen = [], set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if getattr(model, "_mpfused_amp", None) is not None or any(p.dtype in _HALF for p in params):
        fp32_ids = {id(p) for p in params if p.dtype == torch.float32}
    else:
        fp32_ids = {id(p) for _, m in _fp32_islands(model, keep_fp32) for p in m.parameters()}
    weights = grads = master = state = 0
    for p in params:
        n = p.numel()
        is_half = half and id(p) not in fp32_ids
        b = 2 if is_half else 4
        weights += b * n
        if not p.requires_grad:
            continue
        grads += b * n
        master += master_b * n if is_half else 0
        state += 4  # step
        state += (_8bit_state_bytes(n, block_size, states, state_bits)
                  if eight and n >= min_8bit_size
                  else 4 * states * n)
    return MemoryEstimate(recipe, description, sum(p.numel() for p in params), weights, grads,
                          master, state)
