"""Where gradient release's step time goes: thread CPU time of each phase of a training step
(autocast forward, scaled backward, scaler.step + update + zero_grad) of the main job's model,
an ordinary recipe and its release twin alternating step by step (the order flips every round),
medians and the median of the per-round differences release - ordinary. The release moves the
update into the backward: the backward's excess minus the step's saving is what release costs.

    python -m benchmarks.bench_release_phases [--threads 1] [--bucket-kib 256] [--rounds 80]
        [--size small]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import timed_train_step
from benchmarks.main_job import main_job
from mpfused.bench import recipes
from mpfused.bench.presets import SIZE_PRESETS

PAIRS = [("mpfused", "mpfused-release"),
         ("mpfused-8bit-remainder", "mpfused-8bit-remainder-release")]
PHASES = ("fwd", "bwd", "step", "total")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-kib", type=int, default=recipes.RELEASE_BUCKET_BYTES >> 10)
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--size", default="small", choices=sorted(SIZE_PRESETS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipes.RELEASE_BUCKET_BYTES = args.bucket_kib << 10  # read by the release recipes' builds
    n = args.rounds + args.warmup
    job = main_job(args.size, 0, n)
    out = {}
    for pair in PAIRS:
        setups = {r: recipes.RECIPES[r].build(job.base, torch.device("cpu"), torch.bfloat16,
                                              job.hp)
                  for r in pair}
        times = {r: {k: [] for k in PHASES} for r in pair}
        for k in range(n):
            inputs, targets = job.batch(k)
            for r in pair if k % 2 == 0 else pair[::-1]:
                t0, t1, t2, t3 = timed_train_step(setups[r], inputs, targets, time.thread_time)
                if k >= args.warmup:
                    for key, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                        times[r][key].append(v)
        ordinary, release = pair
        row = {f"{r}_{key}_ms": 1e3 * statistics.median(times[r][key])
               for r in pair for key in PHASES}
        row.update({f"diff_{key}_ms": 1e3 * statistics.median(
            b - a for a, b in zip(times[ordinary][key], times[release][key])) for key in PHASES})
        row["same_params"] = all(torch.equal(a, b) for a, b in zip(
            setups[ordinary].model.parameters(), setups[release].model.parameters()))
        out[release] = row
        print(f"{args.threads} thread(s), {args.bucket_kib} KiB buckets, {release} - {ordinary}: "
              + ", ".join(f"{key} {row[f'diff_{key}_ms']:+.3f}" for key in PHASES)
              + f" ms (ordinary total {row[f'{ordinary}_total_ms']:.2f} ms)")
    return out


if __name__ == "__main__":
    main()
