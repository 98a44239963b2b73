"""The fp32 islands of a 16-bit model: which modules ``cast_model`` keeps in fp32 (norm layers by
default, or what ``keep_fp32`` names) and which dtypes count as 16-bit. Shared by the recipes
(mpfused/amp.py) and the memory estimate (mpfused/memory_estimate.py)."""
from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

_HALF = (torch.float16, torch.bfloat16)

_TORCH_NORMS = tuple(t for t in (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                                 getattr(nn, "RMSNorm", None)) if t is not None)
_NORM_NAME = re.compile(r"(RMS|Layer|Group|Batch|Instance)Norm")


def is_norm_layer(name: str, module: nn.Module) -> bool:
    """The default fp32 islands: torch's LayerNorm, GroupNorm, BatchNorm*/SyncBatchNorm,
    InstanceNorm*, RMSNorm, and third-party norms by class name (``LlamaRMSNorm``,
    ``T5LayerNorm``, apex ``FusedLayerNorm`` ...)."""
    return isinstance(module, _TORCH_NORMS) or bool(_NORM_NAME.search(type(module).__name__))


DEFAULT_KEEP_FP32 = (is_norm_layer,)


def _matcher(keep_fp32):
    items = DEFAULT_KEEP_FP32 if keep_fp32 is None else (
        (keep_fp32,) if isinstance(keep_fp32, (str, type)) or callable(keep_fp32)
        else tuple(keep_fp32))
    for item in items:
        if not (isinstance(item, (str, type)) or callable(item)):
            raise TypeError("keep_fp32 items must be module types, module-name patterns (str) or "
                            f"callables (name, module) -> bool, got {item!r}")

    def keep(name: str, module: nn.Module) -> bool:
        for item in items:
            if isinstance(item, type):
                if isinstance(module, item):
                    return True
            elif isinstance(item, str):
                if name == item or fnmatch.fnmatchcase(name, item):
                    return True
            elif item(name, module):
                return True
        return False
    return keep


def _fp32_islands(model: nn.Module, keep_fp32) -> list[tuple[str, nn.Module]]:
    """The outermost modules to keep in fp32 (a kept module's submodules are inside its island)."""
    keep = _matcher(keep_fp32)
    islands: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if keep(name, module):
            islands.append((name, module))
            inside.update(id(m) for m in module.modules())
    return islands
