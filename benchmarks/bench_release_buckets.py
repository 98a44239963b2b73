"""Gradient release's bucket updates apart from the backward (issue 23): the main job's model
(its CPU preset) with the release recipes' buckets, every bucket released in turn with fixed
grads (the check and update each release bucket runs in the backward, then its grads freed),
against the ordinary ``opt.step()`` + ``zero_grad`` of the same params and grads; alternating,
one process, medians and the median per-rep ratio. What the split into release buckets costs
the kernels and the host, without the backward's cache state around them; the whole step with
the backward is ``bench_release``. ``--pollute-mib M``: an M MiB buffer is written before each
release bucket, and as many times before the ordinary step (not timed), as the backward's ops
between two buckets would: how much of each bucket's cost is a cold start.

    python -m benchmarks.bench_release_buckets [--threads 2] [--reps 300] [--bucket-kib 256]
        [--pollute-mib 0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.main_job import main_job
from mpfused.bench import recipes

PAIRS = [("mpfused", "mpfused-release"),
         ("mpfused-8bit-remainder", "mpfused-8bit-remainder-release")]


def steppers(ordinary: str, release: str, base, hp, seed: int = 1, pollute=None):
    """(ordinary step, release buckets' updates, the release buckets' sizes): closures that set
    the same grads and step, returning the seconds they took (``pollute()`` untimed: before
    each bucket, and as many times before the ordinary step)."""
    cpu = torch.device("cpu")
    o = recipes.RECIPES[ordinary].build(base, cpu, torch.bfloat16, hp)
    r = recipes.RECIPES[release].build(base, cpu, torch.bfloat16, hp)
    handle = r.optimizer._grad_release
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen).bfloat16() * 1e-3 for p in o.model.parameters()]
    o_params, r_params = list(o.model.parameters()), list(r.model.parameters())

    def ordinary_step():
        for p, g in zip(o_params, grads):
            p.grad = g
        for _ in handle._chunks if pollute else ():
            pollute()
        t = time.perf_counter()
        o.optimizer.step()
        o.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    def release_buckets():  # what the grad hooks do, bucket by bucket (GradRelease._release)
        for p, g in zip(r_params, grads):
            p.grad = g
        handle._start_backward(cpu, queue_end=False)
        took = 0.0
        with torch.no_grad():
            for chunk in handle._chunks:
                if pollute:
                    pollute()
                t = time.perf_counter()
                chunk.ready.update(chunk.order)
                handle._release(chunk)
                took += time.perf_counter() - t
        handle._in_backward = False
        return took
    sizes = [sum(p.numel() for p in c.params) for c in handle._chunks]
    return ordinary_step, release_buckets, sizes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--bucket-kib", type=int, default=recipes.RELEASE_BUCKET_BYTES >> 10)
    ap.add_argument("--pollute-mib", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipes.RELEASE_BUCKET_BYTES = args.bucket_kib << 10
    job = main_job("small")
    med = statistics.median
    buf = torch.zeros(args.pollute_mib * 2**18)
    pollute = (lambda: buf.add_(1.0)) if args.pollute_mib else None
    print(f"{torch.get_num_threads()} threads, release buckets of {args.bucket_kib} KiB, "
          f"{args.pollute_mib} MiB written before each bucket")
    for ordinary, release in PAIRS:
        fns = steppers(ordinary, release, job.base, job.hp, pollute=pollute)
        for _ in range(10):
            fns[0](), fns[1]()
        times = ([], [])
        for i in range(args.reps):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                times[k].append(fns[k]())
        ratio = med([b / a for a, b in zip(*times)])
        print(f"{ordinary:24} ordinary step {med(times[0]) * 1e6:6.0f} us   {len(fns[2])} release "
              f"buckets ({min(fns[2])}-{max(fns[2])} elements) {med(times[1]) * 1e6:6.0f} us   "
              f"ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
