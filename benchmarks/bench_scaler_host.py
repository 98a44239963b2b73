"""The scaler ops alone at 10,000 tensors: median of single calls, to compare builds (run it in
each tree, alternating) without bench_scaler's side-by-side harness. 1 element per tensor gives
the host cost per tensor; larger tensors add the kernels.

    python -m benchmarks.bench_scaler_host [elements_per_tensor] [dtype]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from mpfused.ops import amp as amp_ops


def _median_us(fn, reps: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[0]) if argv else 1
    dtype = getattr(torch, argv[1]) if len(argv) > 1 else torch.float32
    torch.manual_seed(0)
    grads = [torch.randn(n).to(dtype) for _ in range(10000)]
    found, inv = torch.zeros(()), torch.ones(())  # 1.0 keeps the values across repetitions
    row = {
        "check_us": _median_us(lambda: amp_ops.check_grads(grads, found, inv)),
        "raw_check_us": _median_us(lambda: torch.ops.mpfused.check_grads(grads, found, inv)),
        "unscale_us": _median_us(lambda: amp_ops.unscale_grads_(grads, found, inv)),
        "torch_us": _median_us(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)),
    }
    print(" ".join(f"{k} {v:.0f}" for k, v in row.items()))
    return row


if __name__ == "__main__":
    main()
