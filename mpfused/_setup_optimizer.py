"""The optimizer of ``mpfused.amp.setup``: a name or a class, and whether it takes
``master_weights`` (mpfused's optimizers) or not (torch.optim's: fp32 weights only)."""
from __future__ import annotations

import inspect

import torch

_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "adamw8bit": "AdamW8bit", "adam8bit": "Adam8bit",
               "adamw4bit": "AdamW4bit", "adam4bit": "Adam4bit",
               "sgd": "SGD", "lion": "Lion", "sgd8bit": "SGD8bit", "lion8bit": "Lion8bit",
               "sgd4bit": "SGD4bit", "lion4bit": "Lion4bit"}


def optimizer_class(optimizer):
    if isinstance(optimizer, type):
        return optimizer
    import mpfused
    name = _OPTIMIZERS.get(str(optimizer).lower().replace("_", "").replace("-", ""))
    if name is None:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)} or an optimizer class, "
                         f"got {optimizer!r}")
    cls = getattr(mpfused, name, None)
    if cls is None:
        raise ImportError(f"mpfused.{name} is not available in this build of mpfused")
    return cls


def takes_master_weights(cls) -> bool:
    """mpfused's optimizers (and subclasses, or any class naming the argument) take
    master_weights; torch.optim's and other plain optimizers do not."""
    from mpfused.optim.engine import FusedOptimizer

    if issubclass(cls, FusedOptimizer):
        return True
    try:
        return "master_weights" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def check_plain_optimizer(cls, dtype: torch.dtype, master_weights: str) -> None:
    """An optimizer without master weights (torch.optim.AdamW, ...) is taken for fp32 weights
    only: on 16-bit weights it would keep 16-bit moments and lose every update below the
    weight's precision."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if dtype != torch.float32:
        raise ValueError(
            f"setup(optimizer={name}): this optimizer keeps no fp32 master weights, so it needs "
            f"fp32 weights, but dtype resolves to {dtype}. Pass dtype='fp32' (fp32 weights, "
            "no master) or use optimizer='adamw' / 'adam' / 'adamw8bit' / 'adam8bit' (mpfused "
            "optimizers with fp32 masters for 16-bit weights)")
    if master_weights != "fp32":
        raise ValueError(f"setup(optimizer={name}): master_weights={master_weights!r} is an "
                         "option of mpfused's optimizers; this one keeps none")
