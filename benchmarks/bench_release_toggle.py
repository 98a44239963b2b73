"""Gradient release against the ordinary step on one and the same model and optimizer: the
main job's model trains with its ordinary recipe, and a release handle per bucket size is
attached (``GradRelease.reattach``) for one step and removed after it, the modes taking turns
step by step (the order changing every round). Why not one model per contender, as
bench_release_sweep does: on a 2-core VM two identical ordinary setups built one after the other
differ by up to 1.6% in the same round-robin (their memory lands differently), as much as what
is measured. Here every mode updates the same tensors, and a second ordinary mode
("ordinary-b", the same steps again under another name) shows what is left of the noise.
Attaching and removing happen outside the timed step. All modes compute the same update
(tests/test_release_reattach.py), so the training goes on as one run. ``--workers``: the
release worker's thread counts to time (``step_in_backward(worker_threads=)``; 0: the updates
in the backward's thread; auto: the default, ``worker_threads=None``).

    python -m benchmarks.bench_release_toggle [--pair mpfused] [--kib 128 256 1024 4096]
        [--rounds 100] [--threads 2] [--workers 0 1 auto]
"""
from __future__ import annotations

import statistics
import time

import torch

import mpfused
from benchmarks.bench_release_sweep import bucket_size_args, grads_alive_peak, report
from benchmarks.common import round_robin, timed_train_step
from benchmarks.main_job import main_job
from mpfused.bench.recipes import RECIPES

WARMUP = 5
ORDINARY = ("ordinary", "ordinary-b")


def main(argv=None) -> list[dict]:
    args = bucket_size_args(argv, __doc__, [128, 256, 1024, 4096], 100,
                            more=lambda ap: ap.add_argument("--workers", nargs="+",
                                                            default=["0"]))
    workers = [None if w == "auto" else int(w) for w in args.workers]
    releases = [(kib, w) for kib in args.kib for w in workers]
    job = main_job(args.size, 0, (args.rounds + WARMUP) * (len(releases) + 2) + 1)
    setup = RECIPES[args.pair].build(job.base, torch.device("cpu"), torch.bfloat16, job.hp)
    opt = setup.optimizer
    handles = {}
    for kib, w in releases:  # as the release recipes attach it
        handles[kib, w] = mpfused.step_in_backward(
            opt, scaler=setup.scaler if setup.scaler.is_enabled() else None,
            bucket_bytes=kib << 10, worker_threads=w)
        handles[kib, w].remove()
    batch = iter(range(1, 1 << 30))
    peaks = {}
    for mode in (ORDINARY[0], *releases):
        with _attached(handles.get(mode)):
            peaks[mode] = grads_alive_peak(setup, *job.batch(next(batch)))

    def step(mode):
        inputs, targets = job.batch(next(batch))
        with _attached(handles.get(mode)):
            t = time.perf_counter()
            timed_train_step(setup, inputs, targets)
            return time.perf_counter() - t
    modes = (*ORDINARY, *releases)
    times = round_robin({m: (lambda m=m: step(m)) for m in modes}, args.rounds, WARMUP)
    rows = []
    for m in modes:
        ratios = [b / a for a, b in zip(times[ORDINARY[0]], times[m])]
        rows.append({"mode": m if m in ORDINARY else f"release {m[0]} KiB" + _worker_name(
                         m[1], handles[m]),
                     "buckets": len(handles[m]._chunks) if m in handles else "-",
                     "grads_alive_kib": peaks.get(m, peaks[ORDINARY[0]]) / 1024,
                     "of_full": peaks.get(m, peaks[ORDINARY[0]]) / peaks[ORDINARY[0]],
                     "median_ms": 1e3 * statistics.median(times[m]),
                     "ratio_median": statistics.median(ratios)})
    name = "release-toggle" + ("-worker" if any(w != 0 for w in workers) else "") + (
        f"-{args.size}" if args.size != "small" else "")
    return report(name, args, rows, ["mode", "buckets", "grads_alive_kib", "of_full",
                                     "median_ms", "ratio_median"],
                  "one model and optimizer, modes alternating step by step; ratio_median: per "
                  "round, against 'ordinary'; grads_alive: the p.grad bytes (a worker mode also "
                  "holds the grads of up to WORKER_PENDING + 1 buckets it has taken)")


def _worker_name(requested, handle) -> str:
    """" worker N" / " worker auto (N)"; "" for the backward's thread."""
    if requested == 0:
        return ""
    if requested is not None:
        return f" worker {requested}"
    return f" worker auto ({handle._worker[0] if handle._worker is not None else 0})"


class _attached:
    """A removed release handle attached for the block (none: the ordinary step)."""
    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        if self.handle is not None:
            self.handle.reattach()

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()


if __name__ == "__main__":
    main()
