"""Gradient release's host cost per step, apart from the kernels' work (issue 23): a model of tiny
params (compute negligible) with the main job's layout, 41 bf16 params with fp32 masters
(mpfused.AdamW) in 7 release buckets (the small char GPT's count at its 256 KiB buckets), timed
as whole steps (backward, step, zero_grad) round-robin against the ordinary step in one process.
The difference release - ordinary is the Python of the hooks and the cost of 7 native calls
(each with the bucket's non-finite check) against 1.

    python -m benchmarks.bench_release_host [--rounds 400] [--threads 1] [--numel 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import mpfused
from benchmarks.common import round_order

N_PARAMS, PER_BUCKET = 41, 6


def make_step(release: bool, numel: int, seed: int = 0):
    """A step closure: backward of sum(c_i * p_i) over 41 bf16 params, then step and zero_grad."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g).to(torch.bfloat16))
              for _ in range(N_PARAMS)]
    coefs = [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(N_PARAMS)]
    opt = mpfused.AdamW(params, lr=1e-3, master_weights="fp32")
    if release:
        mpfused.step_in_backward(opt, bucket_bytes=PER_BUCKET * numel * 2)

    def step():
        loss = sum((p * c).sum() for p, c in zip(params, coefs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--numel", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, models = {}, {}
    for name, release in (("ordinary", False), ("release", True)):
        steps[name], models[name] = make_step(release, args.numel)
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    wall = {n: [] for n in steps}
    cpu = {n: [] for n in steps}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        for n in round_order(list(steps), r):
            t, c = time.perf_counter(), time.thread_time()
            steps[n]()
            cpu[n].append(time.thread_time() - c)
            wall[n].append(time.perf_counter() - t)
    load.append(os.getloadavg())
    same = all(torch.equal(a, b) for a, b in zip(models["ordinary"], models["release"]))
    print(f"{N_PARAMS} bf16 params x {args.numel}, {args.threads} threads, {args.rounds} rounds, "
          f"load average {load}")
    for key, times in (("wall", wall), ("thread cpu", cpu)):
        o, r = (1e6 * statistics.median(times[n]) for n in ("ordinary", "release"))
        ratio = statistics.median(b / a for a, b in zip(times["ordinary"], times["release"]))
        print(f"{key:>10}: ordinary {o:7.1f} us, release {r:7.1f} us, release - ordinary "
              f"{r - o:+7.1f} us, ratio (median per round) {ratio:.3f}")
    print(f"same params: {same}")


if __name__ == "__main__":
    main()
