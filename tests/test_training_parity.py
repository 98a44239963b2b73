"""A real training run (char GPT on the Python standard library's sources, under autocast): 16-bit
weights with mpfused.AdamW + fp32 masters (+ mpfused.GradScaler for fp16) follow native AMP
(fp32 weights + torch.amp.GradScaler + torch AdamW) from the same weights and batches.

Tolerance: the final loss (mean of the last 10% of steps) within 2% of native, and the loss curve
(5-step moving average) within 5% of native all along. Half-precision weights change the forward pass (bf16 matmul inputs
were already bf16 under autocast, but LayerNorm/embedding weights now are 16-bit too), so curves
are close, not equal."""
import pytest

from mpfused.bench.runner import BenchOptions, run_benchmark


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
