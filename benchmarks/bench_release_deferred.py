"""Where gradient release's step time goes (issue 23): the main job's model trained by three
recipes alternating step by step in one process: the ordinary step, release, and release with
every bucket's update deferred to the end of the backward (the same calls, back to back: a
diagnostic patch of this process's handle; the grads then pile up). Reported per step: the
whole step, backward + step against the ordinary, and the time inside the bucket releases (and
in the native calls among it) in the backward and at its end, against the ordinary opt.step().
In the backward minus deferred is what interleaving the updates with the backward's ops costs;
deferred minus the ordinary step is what the split into buckets costs. (The clocks around the
native calls cost a little in every recipe, 7 times as often in the release ones at 256 KiB: the
step ratios lean slightly against release.) Both release recipes run the Python grad-ready hook
(the patches time its calls), not the native one users get (csrc/bindings/release_hook.cpp).

    python -m benchmarks.bench_release_deferred [--threads 2] [--bucket-kib 256]
        [--pair mpfused] [--rounds 50]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import round_order, timed_train_step
from benchmarks.main_job import main_job
from mpfused.bench import recipes
from mpfused.ops import bound
from mpfused.optim import release as release_module

WARMUP = 10


def build(pair: str, base, hp) -> dict:
    cpu = torch.device("cpu")
    native_hook = release_module._native_hook
    release_module._native_hook = lambda: None  # (the patches below time the Python hook's path)
    try:
        setups = {k: recipes.RECIPES[pair + ("-release" if k != "ordinary" else "")].build(
            base, cpu, torch.bfloat16, hp) for k in ("ordinary", "release", "deferred")}
    finally:
        release_module._native_hook = native_hook
    clock = {"in": 0.0, "end": 0.0, "native_in": 0.0, "native_end": 0.0, "step": 0.0,
             "where": None}
    live = setups["release"].optimizer._grad_release
    release = live._release

    def timed(chunk):
        clock["where"], t = "in", time.perf_counter()
        release(chunk)
        clock["in"] += time.perf_counter() - t
        clock["where"] = None
    live._release = timed
    deferred, pending = setups["deferred"].optimizer._grad_release, []
    release_later, end = deferred._release, deferred._end_backward

    def hold(chunk):  # the bucket's ready set kept for the end of the backward
        pending.append((chunk, set(chunk.ready)))
        chunk.ready.clear()

    def at_end():
        end()  # (queues the buckets that are partly ready too)
        clock["where"], t = "end", time.perf_counter()
        for chunk, ready in pending:
            chunk.ready.update(ready)
            release_later(chunk)
        clock["end"] += time.perf_counter() - t
        clock["where"] = None
        pending.clear()
    deferred._release, deferred._end_backward = hold, at_end
    for handle in (live, deferred):  # the prepared calls count as native calls too
        handle._prepare_calls = _timing_prepared(handle._prepare_calls, handle, clock)
    opt = setups["ordinary"].optimizer
    step = opt.step

    def timed_step(*a, **k):
        t = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            clock["step"] += time.perf_counter() - t
    opt.step = timed_step
    return setups, clock


def timed_native(fn, clock):
    """fn, its time added to clock["native_in"] or ["native_end"] while a release is timed."""
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if clock["where"]:
                clock["native_" + clock["where"]] += time.perf_counter() - t
    return call


def _timing_prepared(prepare, handle, clock):
    """The handle's _prepare_calls, each armed native call (an ``ArmedStep``) timed
    (timed_native)."""
    def prepare_timed(device):
        prepare(device)
        for chunk in handle._chunks:
            if chunk.call is not None:
                c = chunk.call
                chunk.call = (*c[:2], _TimedArmed(timed_native(c[2].run, clock)), *c[3:])
    return prepare_timed


class _TimedArmed:
    """An armed step whose run() is timed."""
    def __init__(self, run):
        self.run = run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bucket-kib", type=int, default=recipes.RELEASE_BUCKET_BYTES >> 10)
    ap.add_argument("--pair", default="mpfused", choices=["mpfused", "mpfused-8bit-remainder"])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipes.RELEASE_BUCKET_BYTES = args.bucket_kib << 10
    n = args.rounds + WARMUP
    job = main_job("small", 0, n)
    setups, clock = build(args.pair, job.base, job.hp)
    call = bound.BoundOp.__call__
    # the native calls (check + update) inside the releases that take _update
    bound.BoundOp.__call__ = timed_native(call, clock)
    names = list(setups)
    total, bwd_step = {k: [] for k in names}, {k: [] for k in names}
    try:
        for i in range(n):
            if i == WARMUP:
                clock.update({k: 0.0 for k in clock if k != "where"})
            x, y = job.batch(i)
            for k in round_order(names, i):
                t0, t1, _, t3 = timed_train_step(setups[k], x, y)
                if i >= WARMUP:
                    total[k].append(t3 - t0)
                    bwd_step[k].append(t3 - t1)
    finally:
        bound.BoundOp.__call__ = call
    med = statistics.median
    same = all(torch.equal(a, b) for a, b in zip(setups["release"].model.parameters(),
                                                 setups["deferred"].model.parameters()))
    print(f"{torch.get_num_threads()} threads, {args.pair}, release buckets of {args.bucket_kib} "
          f"KiB, {args.rounds} rounds; release and deferred end bit-identical: {same}")
    for k in names:
        d = med([a - b for a, b in zip(bwd_step[k], bwd_step["ordinary"])])
        r = med([a / b for a, b in zip(total[k], total["ordinary"])])
        print(f"  {k:9} step {med(total[k]) * 1e3:7.2f} ms   backward+step vs ordinary "
              f"{d * 1e3:+6.3f} ms   step ratio {r:.4f}")
    per = 1e3 / args.rounds
    print(f"  per step: bucket releases in the backward {clock['in'] * per:.3f} ms (native "
          f"{clock['native_in'] * per:.3f}), deferred to its end {clock['end'] * per:.3f} ms "
          f"(native {clock['native_end'] * per:.3f}); the ordinary opt.step() "
          f"{clock['step'] * per:.3f} ms")
    return {k: v * per for k, v in clock.items() if k != "where"}


if __name__ == "__main__":
    main()
