"""Gradient release's bucket size against step time and grad memory on the main job's model: the
ordinary recipe and its release twin at several ``bucket_bytes``, all alternating step by step in
one process (the order changing every round), so that drift of the machine hits every size
alike. Per size: the number of release buckets, the most grad bytes alive at once in the backward
(summed at every grad-ready hook, in one extra step that is not timed), and the median of the
per-round step ratios release / ordinary. All models end bit-identical (bf16, no clipping).

    python -m benchmarks.bench_release_sweep [--pair mpfused] [--kib 128 256 512 1024 4096]
        [--rounds 40] [--threads 2]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks.common import machine, print_table, round_robin, timed_train_step, write_results
from benchmarks.main_job import main_job
from mpfused.bench import recipes
from mpfused.bench.recipes import RECIPES

WARMUP = 5


def grads_alive_peak(setup, inputs, targets) -> int:
    """The most grad bytes alive at once in one training step's backward."""
    params = list(setup.model.parameters())
    peak = [0]

    def watch(_):
        peak[0] = max(peak[0], sum(p.grad.numel() * p.grad.element_size()
                                   for p in params if p.grad is not None))
    handles = [p.register_post_accumulate_grad_hook(watch) for p in params]
    try:
        timed_train_step(setup, inputs, targets)
    finally:
        for h in handles:
            h.remove()
    return peak[0]


def bucket_size_args(argv, doc: str, kib: list, rounds: int, more=None) -> argparse.Namespace:
    """The command line of the bucket-size benchmarks (this one, bench_release_toggle): the
    recipe pair, the bucket sizes, rounds, threads (set here) and the model size; ``more(ap)``
    adds a benchmark's own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if more is not None:
        more(ap)
    ap.add_argument("--pair", default="mpfused", choices=["mpfused", "mpfused-8bit-remainder"])
    ap.add_argument("--kib", type=int, nargs="+", default=kib)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", default="small")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv=None) -> list[dict]:
    args = bucket_size_args(argv, __doc__, [128, 256, 512, 1024, 4096], 40)
    job = main_job(args.size, 0, args.rounds + WARMUP + 1)
    cpu = torch.device("cpu")
    setups = {"ordinary": RECIPES[args.pair].build(job.base, cpu, torch.bfloat16, job.hp)}
    saved = recipes.RELEASE_BUCKET_BYTES
    try:
        for kib in args.kib:
            recipes.RELEASE_BUCKET_BYTES = kib << 10  # read by the release build
            setups[kib] = RECIPES[args.pair + "-release"].build(job.base, cpu, torch.bfloat16,
                                                               job.hp)
    finally:
        recipes.RELEASE_BUCKET_BYTES = saved
    names = list(setups)
    peaks = {n: grads_alive_peak(setups[n], *job.batch(0)) for n in names}  # batch 0 for all
    counter = {n: 1 for n in names}

    def step(n):
        inputs, targets = job.batch(counter[n])
        counter[n] += 1
        t = time.perf_counter()
        timed_train_step(setups[n], inputs, targets)
        return time.perf_counter() - t
    times = round_robin({n: functools.partial(step, n) for n in names}, args.rounds, WARMUP)
    full = peaks["ordinary"]
    first = list(setups["ordinary"].model.parameters())
    rows = []
    for n in names:
        release = setups[n].optimizer._grad_release
        ratios = [b / a for a, b in zip(times["ordinary"], times[n])]
        rows.append({
            "bucket_kib": "-" if n == "ordinary" else n,
            "buckets": "-" if release is None else len(release._chunks),
            "grads_alive_kib": peaks[n] / 1024, "of_full": peaks[n] / full,
            "median_ms": 1e3 * statistics.median(times[n]),
            "ratio_median": statistics.median(ratios),
            "same_params": all(torch.equal(a, b) for a, b in
                               zip(first, setups[n].model.parameters()))})
    return report("release-sweep", args, rows, ["bucket_kib", "buckets", "grads_alive_kib",
                                                "of_full", "median_ms", "ratio_median",
                                                "same_params"],
                  "one process, round-robin; grads_alive: the most grad bytes alive at once in "
                  "one backward")


def report(name: str, args, rows: list[dict], columns: list[str], note: str) -> list[dict]:
    """The machine, the table, and the result file ``<name>-<pair>-<threads>t`` of a
    bucket-size benchmark."""
    m = machine()
    print(f"{m['cpu']}, {torch.get_num_threads()} threads, torch {m['torch']}, commit "
          f"{m['commit']}; {args.pair} ({args.size} preset), {args.rounds} rounds; {note}")
    print_table(rows, columns)
    path = write_results(f"{name}-{args.pair}-{torch.get_num_threads()}t", "cpu", rows,
                         extra={"size": args.size, "rounds": args.rounds, "note": note})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
