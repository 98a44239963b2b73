"""Training-step time with gradient release (mpfused.step_in_backward) against the ordinary step,
on the main job's model (the char GPT of `python -m mpfused.bench`, its CPU preset by default).

A timed unit is one whole training step (autocast forward, scaled backward, scaler.step,
update, zero_grad): with release the update runs inside the backward, so only the whole step
compares. Both recipes are built from the same initial weights and step through the same
batches; they are timed round-robin in one process (the order changes every round, see
common.round_order) after warm-up steps, so drift of the machine hits both alike. Reported:
median and quartiles of each, and the median of the per-round ratios (paired: robust to load
that comes and goes between rounds), also per block of rounds to show how stable it is. Both
models must end bit-identical (bf16, no clipping: release is exact), which shows the two did the
same work; the result says so (same_params).

    python -m benchmarks.bench_release [--size small] [--rounds 40] [--warmup 5]

``--processes N`` times each recipe in a process of its own instead (N rounds; each round
starts the ordinary and the release recipe once each, in alternating order, each timing
``--rounds`` steps after ``--warmup``): as a user runs one recipe per process. In one process the
two recipes share the allocator's heap, so each one's allocations and frees (release frees every
grad inside the backward, the ordinary step all of them in zero_grad) change what the other's
mallocs cost. Reported: the median of the per-round ratios of the per-process medians; the
processes' final params are compared by digest (same_params).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (machine, print_table, round_order, round_robin, timed_train_step,
                               write_results)
from benchmarks.main_job import main_job
from mpfused.bench.presets import SIZE_PRESETS
from mpfused.bench import recipes
from mpfused.bench.recipes import RECIPES, RELEASE_BUCKET_BYTES

PAIRS = [("mpfused", "mpfused-release"),
         ("mpfused-8bit-remainder", "mpfused-8bit-remainder-release")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_steppers(size: str, dtype, names: list, seed: int, n_batches: int) -> dict:
    """One closure per recipe that trains one step on its next batch (the same batch sequence
    for every recipe), as mpfused/bench/train.py does; the models; the param count."""
    job = main_job(size, seed, n_batches)
    out, models = {}, {}
    for name in names:
        setup = RECIPES[name].build(job.base, torch.device("cpu"), dtype, job.hp)
        counter = [0]

        def step(setup=setup, counter=counter):
            inputs, targets = job.batch(counter[0])
            counter[0] += 1
            timed_train_step(setup, inputs, targets, dtype=dtype)
        out[name], models[name] = step, setup.model
    return out, models, sum(p.numel() for p in job.base.parameters())


def time_round_robin(steppers: dict, rounds: int, warmup: int) -> dict:
    """Seconds of each stepper's steps, round-robin (common.round_robin)."""
    def timed(fn):
        def run():
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return run
    return round_robin({n: timed(fn) for n, fn in steppers.items()}, rounds, warmup)


def solo(args) -> None:
    """One recipe alone in this process (--solo): prints its step times and final-params digest
    as one JSON line."""
    steppers, models, n_params = make_steppers(args.size, DTYPES[args.dtype], [args.solo],
                                               args.seed, args.rounds + args.warmup)
    times = time_round_robin(steppers, args.rounds, args.warmup)[args.solo]
    digest = hashlib.sha256()
    for p in models[args.solo].parameters():
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    print(json.dumps({"times": times, "digest": digest.hexdigest(), "n_params": n_params}))


def time_separate_processes(args, names: list) -> tuple[dict, dict, int]:
    """Each recipe in processes of its own, ``args.processes`` rounds (order alternating): the
    per-process median step times and the digests of the final params."""
    medians, digests = {n: [] for n in names}, {n: set() for n in names}
    n_params = 0
    for r in range(args.processes):
        for name in round_order(names, r):
            cmd = [sys.executable, "-m", "benchmarks.bench_release", "--solo", name,
                   "--size", args.size, "--dtype", args.dtype, "--rounds", str(args.rounds),
                   "--warmup", str(args.warmup), "--seed", str(args.seed),
                   "--bucket-kib", str(args.bucket_kib), "--threads",
                   str(torch.get_num_threads())]
            run = subprocess.run(cmd, capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parents[1])
            if run.returncode != 0:
                raise RuntimeError(f"bench_release --solo {name} failed:\n{run.stderr}")
            out = json.loads(run.stdout.strip().splitlines()[-1])
            medians[name].append(statistics.median(out["times"]))
            digests[name].add(out["digest"])
            n_params = out["n_params"]
    return medians, digests, n_params


def quartiles(xs):
    if len(xs) < 2:  # (statistics.quantiles needs two points)
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZE_PRESETS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4, help="report the ratio per block of rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--bucket-kib", type=int, default=RELEASE_BUCKET_BYTES >> 10,
                    help="release bucket size (default: the main job's recipes'; "
                         "step_in_backward's own default is 4096)")
    ap.add_argument("--processes", type=int, default=0,
                    help="time each recipe in processes of its own, this many rounds")
    ap.add_argument("--solo", help=argparse.SUPPRESS)  # one recipe alone (--processes' workers)
    args = ap.parse_args(argv)
    recipes.RELEASE_BUCKET_BYTES = args.bucket_kib << 10  # read by the release recipes' builds
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.solo:
        return solo(args)
    dtype = DTYPES[args.dtype]
    rows, load = [], [os.getloadavg()]
    for ordinary, release in PAIRS:
        if args.processes:
            times, digests, n_params = time_separate_processes(args, [ordinary, release])
            same = len(digests[ordinary]) == 1 and digests[ordinary] == digests[release]
        else:
            steppers, models, n_params = make_steppers(args.size, dtype, [ordinary, release],
                                                       args.seed, args.rounds + args.warmup)
            times = time_round_robin(steppers, args.rounds, args.warmup)
            same = all(torch.equal(a, b) for a, b in zip(models[ordinary].parameters(),
                                                         models[release].parameters()))
        load.append(os.getloadavg())
        ratios = [b / a for a, b in zip(times[ordinary], times[release])]
        per = max(len(ratios) // args.blocks, 1)
        blocks = [statistics.median(ratios[i:i + per]) for i in range(0, len(ratios), per)]
        for name in (ordinary, release):
            q1, med, q3 = quartiles(times[name])
            rows.append({"recipe": name, "median_ms": 1e3 * med, "q1_ms": 1e3 * q1,
                         "q3_ms": 1e3 * q3, "rounds": args.rounds,
                         "processes": args.processes})  # quartiles over processes if > 0
        rows[-1].update(ratio_median=statistics.median(ratios),
                        ratio_per_block=[round(b, 3) for b in blocks], same_params=same)
    print(f"{machine()['cpu']}, {torch.get_num_threads()} threads, {args.size} preset "
          f"({n_params / 1e6:.2f}M params), {args.dtype}, release bucket "
          f"{args.bucket_kib} KiB; load average {load}")
    print_table(rows, ["recipe", "median_ms", "q1_ms", "q3_ms", "ratio_median",
                       "ratio_per_block", "same_params"])
    tag = "" if args.bucket_kib == RELEASE_BUCKET_BYTES >> 10 else f"-{args.bucket_kib}k"
    if args.processes:
        tag += "-processes"
    if args.size != "small":
        tag += f"-{args.size}"
    path = write_results(f"release-step-{torch.get_num_threads()}t{tag}", "cpu", rows, extra={
        "size": args.size, "bucket_kib": args.bucket_kib, "dtype": args.dtype,
        "n_params": n_params, "warmup": args.warmup,
        "load_average_1_5_15min": load,
        "processes": args.processes,
        "note": ("each recipe in processes of its own, alternating; ratio = release / ordinary "
                 "of the per-process medians, per round" if args.processes else
                 "whole training steps, round-robin in one process; ratio = release / ordinary "
                 "per round")})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
