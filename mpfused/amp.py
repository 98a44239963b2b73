"""Mixed-precision recipes: cast a model with fp32 islands, set up model + optimizer + scaler in one
call, pick the autocast device/dtype, and estimate training-state memory per recipe.

* ``cast_model(model, dtype)`` — fp16/bf16 weights, normalization layers (or any modules you name)
  kept in fp32; forward hooks cast activations into and out of each fp32 island (apex O2's
  keep-batchnorm-fp32, InternEvo's ``NaiveAMPModel``).
* ``setup(model, ...)`` -> ``(model, optimizer, scaler)`` — bf16 where the device supports it
  (scaler disabled), fp16 with an enabled ``mpfused.GradScaler`` otherwise; fp32 master weights in
  the optimizer; TF32 for fp32 matmuls on request.
* ``autocast(model_or_device)`` — ``torch.autocast`` with the right device type and dtype.
* ``estimate_memory(model_or_param_count, recipe)`` — bytes of weights, grads, master weights and
  optimizer state (training state only: activations, temporaries and allocator slack excluded).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

# estimate_memory lives in mpfused/memory_estimate.py; mpfused.amp keeps the names
from mpfused.memory_estimate import RECIPES, MemoryEstimate, estimate_memory  # noqa: F401
from mpfused.fp32_islands import _HALF, DEFAULT_KEEP_FP32, _fp32_islands, is_norm_layer  # noqa: F401

__all__ = ["cast_model", "setup", "autocast", "estimate_memory", "MemoryEstimate", "RECIPES",
           "is_norm_layer", "resolve_dtype", "bf16_supported"]

# ---- dtypes and devices ---------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
           "float32": torch.float32, "float": torch.float32}


def bf16_supported(device) -> bool:
    """Whether ``device`` runs bf16 natively (CUDA: compute capability >= 8.0, no emulation)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        # this device's answer (is_bf16_supported asks about the current device)
        if torch.version.hip:
            with torch.cuda.device(device):
                return bool(torch.cuda.is_bf16_supported())
        return torch.cuda.get_device_capability(device)[0] >= 8
    check = getattr(getattr(torch, device.type, None), "is_bf16_supported", None)
    if check is None:
        return device.type == "mps"
    try:
        return bool(check())
    except Exception:
        return False


def resolve_dtype(dtype, device) -> torch.dtype:
    """``"auto"`` -> bf16 where ``device`` supports it, else fp16; names and torch dtypes pass
    through (``"bf16"``, ``"fp16"``, ``"fp32"``, ``torch.bfloat16`` ...)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float16
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = _DTYPES.get(str(dtype).lower())
    if resolved not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be 'auto', 'bf16', 'fp16', 'fp32' or a matching "
                         f"torch.dtype, got {dtype!r}")
    return resolved


def _module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


# ---- cast_model: 16-bit model with fp32 islands (mpfused/fp32_islands.py) ---------------------
def _map_tensors(obj, fn):
    """obj with fn applied to every tensor in tuples/lists/dicts (containers rebuilt only when
    something changed; dict subclasses such as Hugging Face ``ModelOutput`` are updated in
    place)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_map_tensors(v, fn) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        new = {k: _map_tensors(v, fn) for k, v in obj.items()}
        if all(new[k] is obj[k] for k in obj):
            return obj
        if type(obj) is dict:
            return new
        for k, v in new.items():
            if v is not obj[k]:
                obj[k] = v
        return obj
    return obj


def _caster(src: tuple, dst: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dst) if t.dtype in src else t
    return cast


_TO_FP32 = _caster(_HALF, torch.float32)


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta, ...)
        return False


def _island_pre_hook(module, args, kwargs):
    # Push first, so the post hook (always called) finds its entry even if a cast below fails.
    stack = module.__dict__.setdefault("_mpfused_autocast_stack", [])
    types = {t.device.type for t in module.parameters()} or {"cpu"}
    for arg in list(args) + list(kwargs.values()):
        if isinstance(arg, torch.Tensor):
            types.add(arg.device.type)
    restore = [t for t in sorted(types) if _autocast_enabled(t)]
    stack.append(restore)
    for t in restore:  # an fp32 island computes in fp32, also under autocast
        torch.set_autocast_enabled(t, False)
    return _map_tensors(args, _TO_FP32), _map_tensors(kwargs, _TO_FP32)


def _island_post_hook(dtype, module, args, output):
    stack = module.__dict__.get("_mpfused_autocast_stack")
    if stack:
        for t in stack.pop():
            torch.set_autocast_enabled(t, True)
    return _map_tensors(output, _caster((torch.float32,), dtype))


def _inputs_pre_hook(dtype, module, args, kwargs):
    cast = _caster((torch.float32,), dtype)
    return _map_tensors(args, cast), _map_tensors(kwargs, cast)


def _outputs_post_hook(module, args, output):
    return _map_tensors(output, _TO_FP32)


@dataclass
class CastInfo:
    """What ``cast_model`` did; kept as ``model._mpfused_amp``."""
    dtype: torch.dtype
    fp32_modules: tuple
    fp32_outputs: bool
    cast_inputs: bool
    handles: tuple


def cast_model(model: nn.Module, dtype, keep_fp32=None, fp32_outputs: bool = False, *,
               cast_inputs: bool = True) -> nn.Module:
    """Cast ``model`` in place to ``dtype`` (fp16/bf16) except its fp32 islands; returns it.

    ``keep_fp32``: which modules stay fp32 (with all their submodules) — module types, names
    or ``fnmatch`` patterns of qualified module names (``"lm_head"``, ``"*.norm"``) and/or
    callables ``(name, module) -> bool``. Default: normalization layers (``is_norm_layer``);
    ``()`` keeps nothing.

    Forward hooks on every island cast fp16/bf16 tensor inputs to fp32, run the island with
    autocast disabled, and cast its fp32 outputs back to ``dtype`` (so a bf16 activation entering
    an fp32 LayerNorm is normalized in fp32 and leaves as bf16). On the model itself,
    ``cast_inputs`` casts fp32 tensor inputs to ``dtype`` (integer inputs are untouched) and
    ``fp32_outputs=True`` returns fp32 outputs (tensors in tuples, lists and dicts, including
    Hugging Face ``ModelOutput``).

    Calling it again replaces the previous hooks. A later ``model.to(dtype)`` casts the islands
    too. Floating buffers follow the weights (BatchNorm running stats of islands stay fp32).
    """
    dtype = resolve_dtype(dtype, _module_device(model))
    previous = getattr(model, "_mpfused_amp", None)
    if previous is not None:
        for handle in previous.handles:
            handle.remove()
    islands = _fp32_islands(model, keep_fp32) if dtype != torch.float32 else []
    in_island = {id(m) for _, island in islands for m in island.modules()}

    def to(target):
        return lambda t: t.to(target) if t.is_floating_point() else t

    for module in model.modules():
        if id(module) not in in_island:
            module._apply(to(dtype), recurse=False)
    for _, island in islands:  # after the rest: a weight shared with an island stays fp32
        island._apply(to(torch.float32))

    handles = []
    if not (len(islands) == 1 and islands[0][1] is model):  # the whole model kept fp32: no hooks
        for _, island in islands:
            handles.append(island.register_forward_pre_hook(_island_pre_hook, with_kwargs=True))
            handles.append(island.register_forward_hook(
                functools.partial(_island_post_hook, dtype), always_call=True))
        if cast_inputs and dtype != torch.float32:
            handles.append(model.register_forward_pre_hook(
                functools.partial(_inputs_pre_hook, dtype), with_kwargs=True))
    if fp32_outputs:
        handles.append(model.register_forward_hook(_outputs_post_hook))
    model._mpfused_amp = CastInfo(dtype=dtype, fp32_modules=tuple(n for n, _ in islands),
                                  fp32_outputs=fp32_outputs, cast_inputs=cast_inputs,
                                  handles=tuple(handles))
    return model


# ---- autocast --------------------------------------------------------------------------------
def autocast(model_or_device, dtype=None, *, enabled: bool = True, cache_enabled=None):
    """``torch.autocast`` for a model (its device; the dtype ``cast_model``/``setup`` chose) or a
    device (``"cuda"``, ``torch.device("cpu")``, ...). ``dtype=None`` picks bf16 where the device
    supports it, else fp16; an fp32 recipe gives a disabled context::

        with mpfused.amp.autocast(model):
            loss = loss_fn(model(x), y)
    """
    if isinstance(model_or_device, nn.Module):
        device = _module_device(model_or_device)
        info = getattr(model_or_device, "_mpfused_amp", None)
        if dtype is None and info is not None:
            dtype = info.dtype
    else:
        device = torch.device(model_or_device)
    dtype = resolve_dtype(dtype, device)
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


# ---- setup -----------------------------------------------------------------------------------
def _enable_tf32() -> None:
    # "high": fp32 matmuls may use TF32 (CUDA) or the backend's equivalent; process-wide.
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def setup(model: nn.Module, optimizer="adamw", dtype="auto", lr=1e-3, weight_decay=1e-2,
          device=None, tf32: bool = False, master_weights: str = "fp32", *, keep_fp32=None,
          fp32_outputs: bool = False, scaler_kwargs: dict | None = None, **optimizer_kwargs):
    """One call: ``(model, optimizer, scaler)`` configured for the device.

    * ``model`` is moved to ``device`` (default: where it is) and cast by ``cast_model`` to
      ``dtype``: ``"auto"`` = bf16 where supported, else fp16; ``"fp32"`` leaves it fp32.
    * ``optimizer``: ``"adamw"``, ``"adam"``, ``"adamw8bit"``, ``"adam8bit"``, ``"adamw4bit"``,
      ``"adam4bit"``, ``"sgd"``,
      ``"lion"``, ``"sgd8bit"``, ``"lion8bit"``, ``"sgd4bit"``, ``"lion4bit"`` (mpfused classes) or
      a class, built on ``model.parameters()`` with ``lr``, ``weight_decay``, ``master_weights``
      (``"fp32"``, ``"remainder"`` or ``"remainder8"`` (bf16 only) or ``"none"``) and
      ``optimizer_kwargs``. A class
      without ``master_weights`` (``torch.optim.AdamW``, ...) is built without it and needs
      ``dtype="fp32"`` (fp32 weights, no master); with 16-bit weights it is refused.
    * ``scaler``: ``mpfused.GradScaler(device.type)``, enabled for fp16 only (bf16 and fp32 need no
      loss scaling; a disabled scaler passes through, so the loop is the same).
    * ``tf32=True`` lets fp32 matmuls use TF32 (``torch.set_float32_matmul_precision("high")``,
      ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``); these are
      process-wide settings. ``tf32=False`` leaves them as they are.
    """
    from mpfused._setup_optimizer import (check_plain_optimizer, optimizer_class,
                                          takes_master_weights)
    from mpfused.grad_scaler import GradScaler
    device = _module_device(model) if device is None else torch.device(device)
    dtype = resolve_dtype(dtype, device)
    opt_class = optimizer_class(optimizer)
    takes_master = takes_master_weights(opt_class)
    if not takes_master:  # checked before the model is touched
        check_plain_optimizer(opt_class, dtype, master_weights)
    if master_weights in ("remainder", "remainder8") and dtype != torch.bfloat16:
        raise ValueError(f"master_weights={master_weights!r} needs bf16 weights, but the dtype is "
                         f"{dtype}"
                         " (on this device 'auto' resolves to fp16: use master_weights='fp32')")
    if tf32:
        _enable_tf32()
    model.to(device)
    cast_model(model, dtype, keep_fp32=keep_fp32, fp32_outputs=fp32_outputs)
    if takes_master:
        optimizer_kwargs["master_weights"] = master_weights
    opt = opt_class(model.parameters(), lr=lr, weight_decay=weight_decay, **optimizer_kwargs)
    scaler = GradScaler(device.type, enabled=dtype == torch.float16, **(scaler_kwargs or {}))
    return model, opt, scaler

