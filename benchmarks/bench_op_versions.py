"""What the version-counter bumps cost a step (csrc/bindings/op_versions.cpp): the same optimizer
step on many small tensors through the dispatcher as users call it (the ADInplaceOrView kernel
bumps every written tensor, then redispatches) and below ADInplaceOrView (no bumps: the cost
before the kernel existed), the two taking turns step by step in one process.

    python -m benchmarks.bench_op_versions [--tensors 10000] [--numel 64] [--rounds 40]
        [--threads 1] [--optimizer AdamW]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpfused
from benchmarks.common import machine, print_table, round_robin, write_results


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--optimizer", default="AdamW", choices=["AdamW", "AdamW8bit", "SGD", "Lion"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = [torch.randn(args.numel, dtype=torch.bfloat16) for _ in range(args.tensors)]
    kwargs = {"min_8bit_size": 1} if args.optimizer == "AdamW8bit" else {}
    if args.optimizer == "SGD":
        kwargs["momentum"] = 0.9
    opt = getattr(mpfused, args.optimizer)(params, lr=1e-3, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state exists

    def bumped():
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    def unbumped():
        with torch._C._AutoDispatchBelowADInplaceOrView():
            t = time.perf_counter()
            opt.step()
            return time.perf_counter() - t
    times = round_robin({"bumps": bumped, "no bumps": unbumped}, args.rounds, 3)
    base = statistics.median(times["no bumps"])
    rows = [{"mode": m, "median_ms": 1e3 * statistics.median(t),
             "ratio": statistics.median(t) / base,
             "ns_per_tensor": 1e9 * (statistics.median(t) - base) / args.tensors}
            for m, t in times.items()]
    info = machine()
    print(f"{info['cpu']}, {args.threads} threads, torch {torch.__version__}; {args.optimizer}, "
          f"{args.tensors} bf16 tensors of {args.numel}, {args.rounds} rounds")
    print_table(rows, ["mode", "median_ms", "ratio", "ns_per_tensor"])
    path = write_results(f"op-versions-{args.optimizer}-{args.threads}t", "cpu", rows,
                         {"args": vars(args)})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
