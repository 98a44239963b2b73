"""The training recipes being compared: how each one builds model weights, optimizer and scaler.

Every builder starts from a deepcopy of the same initialized fp32 model, so all recipes begin from
identical weights. A builder raises RecipeUnavailable (with the reason) when its library is not
installed, lacks the class, or cannot be constructed on the device."""
import copy
from dataclasses import dataclass

import torch

from mpfused.bench.optimizers import FAMILIES


class RecipeUnavailable(Exception):
    """The recipe cannot run here; the message says why."""


@dataclass(frozen=True)
class Hyperparameters:
    lr: float
    betas: tuple = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    optimizer: str = "adamw"  # the family every recipe builds (bench/optimizers.py)
    momentum: float = 0.9     # SGD's


def _family(hp):
    return FAMILIES[hp.optimizer]


@dataclass
class TrainSetup:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object              # torch.amp.GradScaler or mpfused.GradScaler
    optimizer_name: str         # what actually runs, e.g. "torch.optim.AdamW(fused=True)"
    scaler_enabled: bool


def scaler_wanted(dtype):
    """Loss scaling only for fp16: bf16 has fp32's exponent range, and torch's own practice (and
    GradScaler on CPU) is to scale fp16 only."""
    return dtype == torch.float16


def _opt_kwargs(hp):
    return _family(hp).kwargs(hp)


def _fp32_copy(base_model, device):
    return copy.deepcopy(base_model).to(device=device, dtype=torch.float32)


def _torch_scaler(device, dtype):
    return torch.amp.GradScaler(device.type, enabled=scaler_wanted(dtype))


def _construct(what, build):
    """Run a constructor, turning any failure into RecipeUnavailable."""
    try:
        return build()
    except RecipeUnavailable:
        raise
    except Exception as exc:  # any library error on this device means "cannot run here"
        raise RecipeUnavailable(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def build_native(base_model, device, dtype, hp):
    model = _fp32_copy(base_model, device)
    cls = _family(hp).torch_class
    cls_name = f"{cls.__module__.replace('.adamw', '').replace('.sgd', '')}.{cls.__name__}"
    # fused is the fastest torch optimizer; foreach, then the for-loop, where fused is unsupported.
    for impl in ("fused", "foreach", None):
        try:
            kwargs = {impl: True} if impl else {}
            optimizer = cls(model.parameters(), **_opt_kwargs(hp), **kwargs)
            name = f"{cls_name}({impl}=True)" if impl else cls_name
            break
        except (RuntimeError, ValueError, TypeError):
            continue
    return TrainSetup(model, optimizer, _torch_scaler(device, dtype), name, scaler_wanted(dtype))


def _mpfused_attr(name):
    try:
        import mpfused
    except Exception as exc:
        raise RecipeUnavailable(f"import mpfused failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(mpfused, name):
        raise RecipeUnavailable(f"mpfused.{name} does not exist (yet) in this build")
    return getattr(mpfused, name)


RELEASE_BUCKET_BYTES = 256 * 1024  # small next to the main job's models: the grads never pile up


def _build_mpfused(base_model, device, dtype, hp, optimizer_class_name, release=False,
                   **optimizer_kwargs):
    optimizer_class = _mpfused_attr(optimizer_class_name)
    scaler_class = _mpfused_attr("GradScaler")
    # 16-bit weights; the optimizer keeps the fp32 (or remainder) master copy.
    model = copy.deepcopy(base_model).to(device=device, dtype=dtype)
    optimizer = _construct(f"mpfused.{optimizer_class_name}", lambda: optimizer_class(
        model.parameters(), **_opt_kwargs(hp), **optimizer_kwargs))
    enabled = scaler_wanted(dtype)
    scaler = _construct("mpfused.GradScaler", lambda: scaler_class(device.type, enabled=enabled))
    kwargs = ", ".join(f"{k}={v!r}" for k, v in optimizer_kwargs.items())
    name = f"mpfused.{optimizer_class_name}({kwargs})"
    if release:  # the step inside the backward; scaler.step(opt) hands over what it found
        step_in_backward = _mpfused_attr("step_in_backward")
        step_in_backward(optimizer, scaler=scaler if enabled else None,
                         bucket_bytes=RELEASE_BUCKET_BYTES)
        name += " + step_in_backward"
    return TrainSetup(model, optimizer, scaler, name, enabled)


def build_mpfused(base_model, device, dtype, hp):
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused,
                          master_weights="fp32")


def build_mpfused_remainder(base_model, device, dtype, hp):
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused,
                          master_weights="remainder")


def build_mpfused_8bit(base_model, device, dtype, hp):
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused_8bit,
                          block_size=256, min_8bit_size=4096, master_weights="fp32")


def build_mpfused_8bit_remainder(base_model, device, dtype, hp):
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused_8bit,
                          block_size=256, min_8bit_size=4096, master_weights="remainder")


def build_mpfused_4bit(base_model, device, dtype, hp):
    if hp.optimizer != "adamw":
        raise RecipeUnavailable(f"4-bit state exists for AdamW only (not {hp.optimizer})")
    return _build_mpfused(base_model, device, dtype, hp, "AdamW4bit",
                          block_size=128, min_8bit_size=4096, master_weights="fp32")


def build_mpfused_4bit_remainder8_release(base_model, device, dtype, hp):
    """The record tier: bf16 weights + int8 correction + 4-bit moments, step in the backward."""
    if hp.optimizer != "adamw":
        raise RecipeUnavailable(f"4-bit state exists for AdamW only (not {hp.optimizer})")
    if dtype != torch.bfloat16:
        raise RecipeUnavailable("the int8 master correction needs bf16 weights")
    return _build_mpfused(base_model, device, dtype, hp, "AdamW4bit", release=True,
                          block_size=128, min_8bit_size=4096, master_weights="remainder8")


def build_mpfused_release(base_model, device, dtype, hp):
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused, release=True,
                          master_weights="fp32")


def build_mpfused_8bit_remainder_release(base_model, device, dtype, hp):
    if dtype != torch.bfloat16:
        raise RecipeUnavailable("the int16 remainder master needs bf16 weights")
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused_8bit, release=True,
                          block_size=256, min_8bit_size=4096, master_weights="remainder")


def build_mpfused_remainder8(base_model, device, dtype, hp):
    if dtype != torch.bfloat16:
        raise RecipeUnavailable("the int8 master correction needs bf16 weights")
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused,
                          master_weights="remainder8")


def build_mpfused_8bit_remainder8(base_model, device, dtype, hp, release=False):
    if dtype != torch.bfloat16:
        raise RecipeUnavailable("the int8 master correction needs bf16 weights")
    return _build_mpfused(base_model, device, dtype, hp, _family(hp).mpfused_8bit, release=release,
                          block_size=256, min_8bit_size=4096, master_weights="remainder8")


def build_mpfused_8bit_remainder8_release(base_model, device, dtype, hp):
    return build_mpfused_8bit_remainder8(base_model, device, dtype, hp, release=True)


def _build_peer(base_model, device, dtype, hp, module_name, class_name):
    if class_name is None:
        raise RecipeUnavailable(f"{module_name} has no 8-bit {hp.optimizer} optimizer")
    try:
        import importlib
        optimizer_class = getattr(importlib.import_module(module_name), class_name)
    except Exception as exc:
        raise RecipeUnavailable(f"{module_name} is not usable: {type(exc).__name__}: {exc}") from exc
    model = _fp32_copy(base_model, device)
    name = f"{module_name}.{class_name}"
    optimizer = _construct(name, lambda: optimizer_class(model.parameters(), **_opt_kwargs(hp)))
    return TrainSetup(model, optimizer, _torch_scaler(device, dtype), name, scaler_wanted(dtype))


def build_bnb(base_model, device, dtype, hp):
    return _build_peer(base_model, device, dtype, hp, "bitsandbytes.optim", _family(hp).bnb)


def build_torchao(base_model, device, dtype, hp):
    return _build_peer(base_model, device, dtype, hp, "torchao.optim", _family(hp).torchao)


# The summaries name the AdamW family (the default); --optimizer sgd|lion builds the same recipes
# with that family's classes (bench/optimizers.py), and each result records what ran.
@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    build: object  # (base_model, device, dtype, Hyperparameters) -> TrainSetup


RECIPES = {r.name: r for r in [
    Recipe("native", "fp32 weights + autocast + torch GradScaler + torch AdamW", build_native),
    Recipe("mpfused", "16-bit weights + mpfused.AdamW (fp32 master) + mpfused.GradScaler",
           build_mpfused),
    Recipe("mpfused-8bit", "16-bit weights + mpfused.AdamW8bit (fp32 master, 8-bit m/v)",
           build_mpfused_8bit),
    Recipe("bnb", "fp32 weights + autocast + torch GradScaler + bitsandbytes AdamW8bit",
           build_bnb),
    Recipe("torchao", "fp32 weights + autocast + torch GradScaler + torchao AdamW8bit",
           build_torchao),
    # Opt-in (not in the default list): bf16 weights + int16 remainder instead of an fp32 master.
    Recipe("mpfused-remainder", "bf16 weights + mpfused.AdamW (int16 remainder master)",
           build_mpfused_remainder),
    Recipe("mpfused-8bit-remainder", "bf16 weights + mpfused.AdamW8bit (int16 remainder master)",
           build_mpfused_8bit_remainder),
    # Opt-in: 4-bit moments (torchao's AdamW4bit format, block 128).
    Recipe("mpfused-4bit", "16-bit weights + mpfused.AdamW4bit (fp32 master, 4-bit m/v)",
           build_mpfused_4bit),
    # Gradient release (mpfused.step_in_backward): the step inside the backward, no grad buffer.
    Recipe("mpfused-release", "16-bit weights + mpfused.AdamW (fp32 master), step in backward",
           build_mpfused_release),
    Recipe("mpfused-8bit-remainder-release",
           "bf16 weights + mpfused.AdamW8bit (int16 remainder), step in backward",
           build_mpfused_8bit_remainder_release),
    # The one-byte master correction (a 24-bit master): 2 + 1 + ~2 B/param with release.
    Recipe("mpfused-remainder8", "bf16 weights + mpfused.AdamW (int8 correction: 24-bit master)",
           build_mpfused_remainder8),
    Recipe("mpfused-8bit-remainder8",
           "bf16 weights + mpfused.AdamW8bit (int8 correction: 24-bit master)",
           build_mpfused_8bit_remainder8),
    Recipe("mpfused-8bit-remainder8-release",
           "bf16 weights + mpfused.AdamW8bit (int8 correction), step in backward",
           build_mpfused_8bit_remainder8_release),
    # The record tier: 2 (bf16) + 1 (int8 correction) + ~1.06 (4-bit m, v) B/param, no grads.
    Recipe("mpfused-4bit-remainder8-release",
           "bf16 weights + mpfused.AdamW4bit (int8 correction), step in backward",
           build_mpfused_4bit_remainder8_release),
]}

DEFAULT_RECIPES = ["native", "mpfused", "mpfused-8bit", "bnb", "torchao"]
