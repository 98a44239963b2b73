"""One recipe's training run, timed the same way for every recipe.

Per step the clock is read three times, each after a device synchronize (CUDA) so that queued
kernels are charged to the phase that launched them:
  t0 | forward + scaled backward | t1 | scaler.step + scaler.update + zero_grad | t2
The first `warmup_steps` steps (allocation of lazy state, torch.compile, cuDNN/AMX autotuning) are
trained on but not timed; the training-state snapshot is taken on the last of them, after the
optimizer step and before zero_grad, when weights, grads and optimizer state all exist."""
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from mpfused.bench.data import make_batch
from mpfused.bench.memory import cuda_peak_bytes, reset_peak_memory, training_state_bytes


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)       # timed steps only
    optimizer_seconds: list = field(default_factory=list)  # timed steps only
    state_bytes: dict = None
    cuda_peak_bytes: int = None
    validation_loss: float = None
    final_scale: float = None


class StepFailed(Exception):
    def __init__(self, step, exc):
        super().__init__(f"failed at training step {step}: {type(exc).__name__}: {exc}")
        self.step = step


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device):
    _synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def validation_loss(model, tokens, offsets, context_length, device, dtype):
    """Mean loss over fixed held-out batches (same for every recipe)."""
    model.eval()
    losses = []
    for batch_offsets in offsets:
        inputs, targets = make_batch(tokens, batch_offsets, context_length)
        with torch.autocast(device.type, dtype=dtype):
            losses.append(model(inputs, targets).item())
    model.train()
    return sum(losses) / len(losses)


def train_recipe(setup, train_tokens, train_offsets, context_length, device, dtype, warmup_steps,
                 progress_label):
    """Train `setup` on the batches given by train_offsets (one row per step)."""
    model, optimizer, scaler = setup.model, setup.optimizer, setup.scaler
    result = TrainResult()
    steps = len(train_offsets)
    model.train()
    reset_peak_memory(device)
    bar = tqdm(range(steps), desc=f"{progress_label:>14}", unit="step", leave=True)
    for step in bar:
        inputs, targets = make_batch(train_tokens, train_offsets[step], context_length)
        try:
            t0 = _clock(device)
            with torch.autocast(device.type, dtype=dtype):
                loss = model(inputs, targets)
            scaler.scale(loss).backward()
            t1 = _clock(device)
            scaler.step(optimizer)
            scaler.update()
            if step == warmup_steps - 1:
                result.state_bytes = training_state_bytes(model, optimizer, scaler)
            optimizer.zero_grad(set_to_none=True)
            t2 = _clock(device)
        except Exception as exc:
            bar.close()
            raise StepFailed(step, exc) from exc
        result.losses.append(loss.item())
        if step >= warmup_steps:
            result.step_seconds.append(t2 - t0)
            result.optimizer_seconds.append(t2 - t1)
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        if not math.isfinite(result.losses[-1]) and not setup.scaler_enabled:
            # Without a scaler nothing recovers from a non-finite loss; stop burning time.
            bar.close()
            break
    result.cuda_peak_bytes = cuda_peak_bytes(device)
    if setup.scaler_enabled:
        result.final_scale = float(scaler.get_scale())
    return result
