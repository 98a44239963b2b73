"""The real-text training parity test (tests/test_training_parity.py's char GPT on the stdlib's
sources, bf16, 200 steps, lr 1e-3) for 4-bit moments: mpfused.AdamW4bit (bench recipe
"mpfused-4bit": block_size 128, min_8bit_size 4096, so every matrix of the tiny GPT gets packed
4-bit m / v) against mpfused.AdamW (fp32 m / v), both with bf16 weights + fp32 masters, same init,
batches and hyperparameters; within the tolerance the 8-bit test uses (1% on the final loss, the
mean training loss of the last 20 steps)."""
import pytest
import torch

from tests.parity_runs import recipe_runs
from tests.test_training_parity import (PARITY_8BIT_SIZE, PARITY_8BIT_STEPS,
                                        PARITY_8BIT_TOLERANCE_PCT, SIZE_PRESETS, BenchOptions,
                                        _elements, dataclasses)


def test_adamw4bit_follows_32bit_state(monkeypatch):
    """Measured gap (4-bit vs 32-bit final loss) at 200 steps, bf16, on the loaded 2-core CPU box:
    seeds 0, 1, 2, 3, 5: +0.60 +0.10 +0.04 +0.75 +0.22 % (max 0.75%; 4-bit is a little behind,
    never ahead; the 8-bit gaps at the same settings: max |gap| 0.45%, std 0.27%). This test's
    seed is 3, the worst of these. Why the same 1% as 8-bit holds: see
    test_adamw8bit_follows_32bit_state (lr 1e-3 keeps the run out of its chaotic regime)."""
    monkeypatch.setitem(SIZE_PRESETS, PARITY_8BIT_SIZE,
                        dataclasses.replace(SIZE_PRESETS["tiny"], lr=1e-3))
    opts = BenchOptions(device="cpu", size=PARITY_8BIT_SIZE, dtype="bf16",
                        steps=PARITY_8BIT_STEPS, recipes=["mpfused", "mpfused-4bit"], seed=3)
    results, optimizers = recipe_runs(opts)  # "mpfused": trained once for the parity tests
    ref, ours = results["mpfused"], results["mpfused-4bit"]
    for r in (ref, ours):
        assert r["status"] == "ok", r.get("reason")
    assert ours["optimizer"].startswith("mpfused.AdamW4bit("), ours["optimizer"]
    assert ref["losses"][-1] < ref["losses"][0] - 1.0  # it does learn
    opt4 = optimizers["mpfused-4bit"]
    packed = sum(p.numel() for g in opt4.param_groups for p in g["params"]
                 if opt4.state[p]["exp_avg"].numel() == (p.numel() + 1) // 2
                 and opt4.state[p]["exp_avg"].dtype == torch.uint8)
    share = packed / _elements(opt4)
    assert share > 0.5, f"only {share:.1%} of the elements have 4-bit state"
    gap_pct = 100 * (ours["final_loss"] - ref["final_loss"]) / ref["final_loss"]
    assert abs(gap_pct) < PARITY_8BIT_TOLERANCE_PCT, (
        f"4-bit final loss {ours['final_loss']:.4f} vs 32-bit {ref['final_loss']:.4f}: "
        f"{gap_pct:+.2f}% (4-bit state on {share:.1%} of the elements)")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
