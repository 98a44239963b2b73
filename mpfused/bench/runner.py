"""Runs every requested recipe on the same initial weights and the same batches.

The base model is initialized once (seeded) on the CPU in fp32; each recipe deep-copies it to the
device in its own weight dtype. The batches are a pre-generated table of offsets into the corpus,
shared by all recipes, so loss differences come from the recipes alone."""
import gc
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from mpfused.bench.data import VOCAB_SIZE, batch_offsets, load_stdlib_corpus
from mpfused.bench.model import CharGPT, GPTConfig
from mpfused.bench.presets import SIZE_PRESETS
from mpfused.bench.recipes import RECIPES, Hyperparameters, RecipeUnavailable
from mpfused.bench.train import StepFailed, train_recipe, validation_loss
from mpfused.info import source_commit

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VALIDATION_BATCHES = 8


@dataclass
class BenchOptions:
    device: str
    size: str
    dtype: str = "bf16"
    steps: int = None          # None: the preset's default
    recipes: list = field(default_factory=list)
    seed: int = 0
    optimizer: str = "adamw"  # the optimizer family every recipe builds (bench/optimizers.py)


def warmup_steps_for(steps):
    """A few untimed steps: enough for lazy state and compilation, at most a fifth of the run."""
    return min(5, max(1, steps // 5))


def final_loss_window(steps):
    """Final loss = mean over the last ~10% of steps (smooths batch-to-batch noise)."""
    return max(1, steps // 10)


def _median_ms(seconds):
    return 1e3 * statistics.median(seconds) if seconds else None


def _finite_or_none(x):
    return x if x is not None and math.isfinite(x) else None


def _summarize(train, n_params, device, steps):
    losses = train.losses
    final = sum(losses[-final_loss_window(steps):]) / final_loss_window(steps)
    if len(losses) < steps:  # stopped early on a non-finite loss
        final = float("nan")
    state = train.state_bytes or {}
    peak = train.cuda_peak_bytes if device.type == "cuda" else state.get("total")
    return {
        "status": "ok",
        "step_time_ms": _median_ms(train.step_seconds),
        "optimizer_time_ms": _median_ms(train.optimizer_seconds),
        "timed_steps": len(train.step_seconds),
        "peak_memory_bytes": peak,
        "peak_memory_source": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                               else "tensor accounting (weights+grads+optimizer state+scaler)"),
        "state_bytes": state,
        "state_bytes_per_param": {k: v / n_params for k, v in state.items()},
        "final_loss": _finite_or_none(final),
        "validation_loss": _finite_or_none(train.validation_loss),
        "final_scale": train.final_scale,
        "losses": [_finite_or_none(x) for x in losses],
        "step_times_ms": [1e3 * s for s in train.step_seconds],
        "optimizer_times_ms": [1e3 * s for s in train.optimizer_seconds],
    }


def run_benchmark(options, log=print):
    """Train each recipe in options.recipes; returns the results as a JSON-ready dict."""
    device = torch.device(options.device)
    dtype = DTYPES[options.dtype]
    preset = SIZE_PRESETS[options.size]
    steps = options.steps or preset.steps
    warmup = warmup_steps_for(steps)
    if steps < 2:
        raise ValueError("need at least 2 steps (1 warm-up + 1 timed)")

    corpus = load_stdlib_corpus()
    train_tokens = corpus.train.to(device)
    validation_tokens = corpus.validation.to(device)
    ctx, batch = preset.context_length, preset.batch_size
    train_offsets = batch_offsets(len(corpus.train), ctx, batch, steps, options.seed)
    validation_offsets = batch_offsets(len(corpus.validation), ctx, batch, VALIDATION_BATCHES,
                                       options.seed + 1)

    model_config = GPTConfig(vocab_size=VOCAB_SIZE, context_length=ctx, n_layer=preset.n_layer,
                             n_head=preset.n_head, d_model=preset.d_model)
    torch.manual_seed(options.seed)
    base_model = CharGPT(model_config)
    n_params = sum(p.numel() for p in base_model.parameters())
    hp = Hyperparameters(lr=preset.lr, optimizer=options.optimizer)

    config = {
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu, %d threads" % torch.get_num_threads()),
        "dtype": options.dtype, "size": options.size, "steps": steps, "warmup_steps": warmup,
        "final_loss_window": final_loss_window(steps), "seed": options.seed,
        "model": vars(model_config), "n_params": n_params, "batch_size": batch,
        "hyperparameters": vars(hp),
        "grad_scaler": ("enabled (fp16 autocast needs loss scaling)" if dtype == torch.float16 else
                        "disabled (enabled=False): bf16 has fp32's exponent range; torch scales "
                        "fp16 only"),
        "corpus": {"source": "Python stdlib sources", "files": len(corpus.files),
                   "chars": corpus.n_chars, "train_tokens": len(corpus.train)},
        "torch": torch.__version__, "commit": source_commit(), "date": time.strftime("%Y-%m-%d"),
    }
    log(f"model: {n_params / 1e6:.2f}M params ({preset.n_layer} layers, d={preset.d_model}), "
        f"{steps} steps x {batch}x{ctx} chars, {options.dtype} autocast on {config['device_name']}")
    log(f"data: {corpus.n_chars / 1e6:.1f}M chars from {len(corpus.files)} stdlib modules")
    log(f"GradScaler: {config['grad_scaler']}")

    results = {}
    for name in options.recipes:
        recipe = RECIPES[name]
        entry = {"summary": recipe.summary}
        results[name] = entry
        recipe_started = time.perf_counter()
        try:
            setup = recipe.build(base_model, device, dtype, hp)
        except RecipeUnavailable as exc:
            entry.update(status="unavailable", reason=str(exc))
            log(f"{name}: unavailable on {device.type}: {exc}")
            continue
        entry.update(optimizer=setup.optimizer_name, scaler_enabled=setup.scaler_enabled,
                     weights_dtype=str(next(setup.model.parameters()).dtype).replace("torch.", ""))
        torch.manual_seed(options.seed)
        try:
            train = train_recipe(setup, train_tokens, train_offsets, ctx, device, dtype, warmup,
                                 progress_label=name)
            train.validation_loss = validation_loss(setup.model, validation_tokens,
                                                    validation_offsets, ctx, device, dtype)
        except StepFailed as exc:
            entry.update(status="unavailable", reason=str(exc))
            log(f"{name}: unavailable on {device.type}: {exc}")
        else:
            entry.update(_summarize(train, n_params, device, steps))
        # Everything this recipe cost, warm-up and compilation included (not a speed metric).
        entry["wall_seconds"] = round(time.perf_counter() - recipe_started, 1)
        del setup
        gc.collect()

    native_loss = results.get("native", {}).get("final_loss")
    for entry in results.values():
        loss = entry.get("final_loss")
        entry["final_loss_gap_pct"] = (100 * (loss - native_loss) / native_loss
                                       if loss is not None and native_loss else None)
    return {"config": config, "recipes": results}
