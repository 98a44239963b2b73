"""A real training run (char GPT on the Python standard library's sources, under autocast): 16-bit
weights with mpfused.AdamW + fp32 masters (+ mpfused.GradScaler for fp16) follow native AMP
(fp32 weights + torch.amp.GradScaler + torch AdamW) from the same weights and batches.

Tolerance: the final loss (mean of the last 10% of steps) within 2% of native, and the loss curve
(5-step moving average) within 5% of native all along. Half-precision weights change the forward
pass (bf16 matmul inputs were already bf16 under autocast, but LayerNorm/embedding weights now are
16-bit too), so curves are close, not equal.

The same training also compares mpfused.AdamW8bit (8-bit optimizer state) with mpfused.AdamW
(32-bit state): see test_adamw8bit_follows_32bit_state for what is compared and why the tolerance holds."""
import dataclasses

import pytest
import torch

from mpfused.bench.presets import SIZE_PRESETS
from mpfused.bench.runner import BenchOptions, run_benchmark
from tests.parity_runs import recipe_runs


def smooth(xs, k=5):
    return [sum(xs[i:i + k]) / k for i in range(len(xs) - k + 1)]


@pytest.mark.parametrize("dtype,recipes", [("bf16", ["mpfused", "mpfused-remainder"]),
                                           ("fp16", ["mpfused"])])
def test_mpfused_follows_native_amp(dtype, recipes):
    opts = BenchOptions(device="cpu", size="tiny", dtype=dtype, steps=50,
                        recipes=["native"] + recipes, seed=3)
    results = run_benchmark(opts, log=lambda *a: None)["recipes"]
    native = results["native"]
    assert native["status"] == "ok"
    assert native["losses"][-1] < native["losses"][0] - 0.5  # it does learn
    for name in recipes:
        r = results[name]
        assert r["status"] == "ok", r.get("reason")
        assert abs(r["final_loss_gap_pct"]) < 2.0, (name, r["final_loss_gap_pct"])
        for ours, theirs in zip(smooth(r["losses"]), smooth(native["losses"])):
            assert abs(ours - theirs) / theirs < 0.05


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_sgd_and_lion_follow_native_amp(optimizer):
    """mpfused.SGD (momentum 0.9) and mpfused.Lion with bf16 weights + fp32 masters under bf16
    autocast against the fp32-weights torch optimizer (torch.optim.SGD; for Lion, which torch does
    not have, lion-pytorch's update in torch ops: mpfused/bench/optimizers.py), same weights and
    batches, with the tolerances of test_mpfused_follows_native_amp. Measured (seed 3, 50 steps):
    SGD gap -0.01%, Lion within 2% (Lion's sign update makes its run more sensitive to the bf16
    forward pass than AdamW's)."""
    opts = BenchOptions(device="cpu", size="tiny", dtype="bf16", steps=50,
                        recipes=["native", "mpfused"], seed=3, optimizer=optimizer)
    results = run_benchmark(opts, log=lambda *a: None)["recipes"]
    native, ours = results["native"], results["mpfused"]
    assert native["status"] == "ok" and ours["status"] == "ok", ours.get("reason")
    assert native["losses"][-1] < native["losses"][0] - 0.5  # it does learn
    assert abs(ours["final_loss_gap_pct"]) < 2.0, ours["final_loss_gap_pct"]
    for a, b in zip(smooth(ours["losses"]), smooth(native["losses"])):
        assert abs(a - b) / b < 0.05


def _elements(optimizer, state_dtype=None):
    """Elements of the optimizer's params, all of them or those whose exp_avg has state_dtype."""
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"]
               if state_dtype is None or optimizer.state[p]["exp_avg"].dtype == state_dtype)


PARITY_8BIT_SIZE = "tiny-lr1e-3"  # the tiny preset with lr 1e-3 instead of 3e-3 (see below)
PARITY_8BIT_STEPS = 200
PARITY_8BIT_TOLERANCE_PCT = 1.0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_adamw8bit_follows_32bit_state(dtype, monkeypatch):
    """mpfused.AdamW8bit (bench recipe "mpfused-8bit": block_size 256, min_8bit_size 4096, so every
    matrix of the tiny GPT, ~97% of its elements, gets uint8 m/v) against mpfused.AdamW (recipe
    "mpfused": fp32 m/v); both with 16-bit weights + fp32 masters under bf16/fp16 autocast
    (+ mpfused.GradScaler for fp16), from the same init, on the same stdlib batches, with the same
    hyperparameters. Only the optimizer state's precision differs.

    Compared: the final loss, i.e. the runner's final_loss = mean training loss of the last 10% of
    steps (20 of 200), which removes single-batch noise. Asserted: 8-bit within 1% of 32-bit.

    Why lr 1e-3 rather than the tiny preset's 3e-3: at 3e-3 the tiny run is chaotic. There the final
    loss of a single run moves by percents under any perturbation: 8-bit vs 32-bit gaps of up to
    4% (std 1.3%, 36 seeds, 100 steps) and up to 3.5% at 50 steps; even two 32-bit-state recipes
    (fp32 master vs int16 remainder) differ by up to 2.4%, so a 1% check there would test chaos, not
    the 8-bit state. At 1e-3 (which also trains better: 2.48 vs ~2.6 after 200 steps) the
    fp32-vs-remainder floor is <= 0.26% and the 8-bit gap measured at 200 steps (last 20), seeds
    0-11, on the 2-core CPU box was:
      bf16: -0.31 +0.35 -0.06 -0.11 -0.01 -0.13 -0.36 -0.00 +0.01 +0.39 -0.38 -0.45 %
            (max |gap| 0.45%, std 0.27%)
      fp16: -0.23 +0.33 +0.21 +0.10 +0.19 +0.16 -0.08 +0.44 -0.00 +0.16 +0.15 -0.05 %
            (max |gap| 0.44%, std 0.18%)
    (this test's seed 3: -0.11% bf16, +0.10% fp16), so 1% is more than twice the worst seed. A
    broken 8-bit run fails it: its lr x10 gives +11% to +15%, lr x0.7 gives +1.3% to +2.1%."""
    monkeypatch.setitem(SIZE_PRESETS, PARITY_8BIT_SIZE,
                        dataclasses.replace(SIZE_PRESETS["tiny"], lr=1e-3))
    opts = BenchOptions(device="cpu", size=PARITY_8BIT_SIZE, dtype=dtype, steps=PARITY_8BIT_STEPS,
                        recipes=["mpfused", "mpfused-8bit"], seed=3)
    results, optimizers = recipe_runs(opts)  # "mpfused": trained once for the parity tests
    ref, ours = results["mpfused"], results["mpfused-8bit"]
    for r in (ref, ours):
        assert r["status"] == "ok", r.get("reason")
    assert ref["optimizer"].startswith("mpfused.AdamW("), ref["optimizer"]
    assert ours["optimizer"].startswith("mpfused.AdamW8bit("), ours["optimizer"]
    assert ref["losses"][-1] < ref["losses"][0] - 1.0  # it does learn

    # What is compared really is 8-bit state against 32-bit state.
    opt32, opt8 = optimizers["mpfused"], optimizers["mpfused-8bit"]
    assert _elements(opt32, torch.float32) == _elements(opt32) > 0
    share_8bit = _elements(opt8, torch.uint8) / _elements(opt8)
    assert share_8bit > 0.5, f"only {share_8bit:.1%} of the elements have 8-bit state"

    gap_pct = 100 * (ours["final_loss"] - ref["final_loss"]) / ref["final_loss"]
    assert abs(gap_pct) < PARITY_8BIT_TOLERANCE_PCT, (
        f"8-bit final loss {ours['final_loss']:.4f} vs 32-bit {ref['final_loss']:.4f}: "
        f"{gap_pct:+.2f}% (8-bit state on {share_8bit:.1%} of the elements)")
