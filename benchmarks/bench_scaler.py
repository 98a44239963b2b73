"""Check + unscale throughput: mpfused (fused, all dtypes in one call; read-only check variant)
against torch._amp_foreach_non_finite_check_and_unscale_ on the same grads, timed side by side
(benchmarks.common.side_by_side: round-robin, so machine drift hits all three alike).

    python benchmarks/bench_scaler.py [--device cpu|cuda] [--totals 10000000,...] [--counts 1,100,10000]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import stream_bandwidth_at, print_table, side_by_side, split_sizes, write_results
from mpfused.ops import amp as amp_ops


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--totals", default="10000000")
    ap.add_argument("--counts", default="1,100,10000")
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args(argv)
    dev = args.device
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    rows = []
    for total in map(int, args.totals.split(",")):
        for count in map(int, args.counts.split(",")):
            for name in args.dtypes.split(","):
                dt = dtypes[name]
                grads = [torch.randn(n, device=dev).to(dt) for n in split_sizes(total, count)]
                found = torch.zeros((), device=dev)
                inv = torch.ones((), device=dev)  # 1.0 keeps values stable across repetitions
                nbytes = total * grads[0].element_size()
                row = {"total": total, "tensors": count, "dtype": name}
                bw = stream_bandwidth_at(dev, 2 * nbytes)  # the unscale pass's working set
                row["stream_GBps"] = bw / 1e9
                fns = {"unscale": lambda: amp_ops.unscale_grads_(grads, found, inv),
                       "check": lambda: amp_ops.check_grads(grads, found, inv)}
                torch_fn = lambda: torch._amp_foreach_non_finite_check_and_unscale_(  # noqa: E731
                    grads, found, inv)
                try:
                    torch_fn()
                    fns["torch"] = torch_fn
                except RuntimeError as exc:  # torch's CUDA kernel rejects bf16
                    row["torch_ms"] = None
                    row["torch_error"] = str(exc).splitlines()[0][:80]
                t = side_by_side(fns, dev)
                row["mpfused_unscale_ms"] = t["unscale"] * 1e3
                row["mpfused_unscale_bw_frac"] = 2 * nbytes / t["unscale"] / bw
                row["mpfused_check_ms"] = t["check"] * 1e3
                row["mpfused_check_bw_frac"] = nbytes / t["check"] / bw
                if "torch" in t:
                    row["torch_ms"] = t["torch"] * 1e3
                    row["speedup_unscale"] = row["torch_ms"] / row["mpfused_unscale_ms"]
                    row["speedup_check"] = row["torch_ms"] / row["mpfused_check_ms"]
                rows.append(row)
                print_table([row], list(row))
    cols = ["total", "tensors", "dtype", "torch_ms", "mpfused_unscale_ms", "speedup_unscale",
            "mpfused_check_ms", "speedup_check", "mpfused_unscale_bw_frac"]
    print_table(rows, cols)
    print(write_results("scaler", dev, rows, {}))


if __name__ == "__main__":
    main()
