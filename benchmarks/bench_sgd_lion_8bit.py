"""CPU step time of the one-state 8-bit ops (sgd8bit_step_, lion8bit_step_, native kernel) against
bitsandbytes' SGD8bit / Lion8bit on CPU, one fp32 tensor per size, in one process.

Both sides start from the same param, grad and state (bitsandbytes' 256-element blocks and signed
map) and step the same tensor again and again (the grad fixed: the work per step is the same).
Timing: warm-up, then the contenders take turns (benchmarks.common.round_order), medians of
the wall time of one step and of the process CPU time of one step (all threads; on a shared
machine steadier than wall time, and exact with --threads 1). Each row also gives the step over
the bytes it must move (param read + write, grad read, codes read + write, the absmax: 14.03
B/param) at the measured in-place stream bandwidth of the same working set (x_limit).
Not a test:
    python -m benchmarks.bench_sgd_lion_8bit [--sizes 1e6 1e7] [--reps 21] [--threads N] [--write]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (machine, print_table, round_order,  # noqa: E402
                               stream_bandwidth_at, write_results)
from mpfused import quant_maps as qm  # noqa: E402
from mpfused.ops import OPS  # noqa: E402

BLOCK = 256
BYTES_PER_PARAM = 4 + 4 + 4 + 1 + 1 + 4 / BLOCK  # param r/w, grad, codes r/w, absmax


def _contenders(kind: str, n: int) -> dict:
    import bitsandbytes as bnb

    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g) * 0.02
    grad = torch.randn(n, generator=g) * 1e-3
    state, absmax = qm.quantize_blockwise(torch.randn(n, generator=g) * 1e-3, qm.signed_map(),
                                          BLOCK)
    ours = [p0.clone(), state.clone(), absmax.clone(), torch.full((), 1.0)]
    pb = torch.nn.Parameter(p0.clone())
    pb.grad = grad.clone()
    if kind == "sgd":
        ob = bnb.optim.SGD8bit([pb], lr=1e-3, momentum=0.9, min_8bit_size=1)
    else:
        ob = bnb.optim.Lion8bit([pb], lr=1e-4, betas=(0.9, 0.99), min_8bit_size=1)
    ob.step()  # creates bnb's state
    sb = ob.state[pb]
    sb["state1"].copy_(state)
    sb["absmax1"].copy_(absmax)
    qmap = qm.signed_map()

    def mpfused_step():
        p, c, a, s = ours
        if kind == "sgd":
            OPS["sgd8bit_step_"]([p], [grad], [c], [a], [], [s], qmap, block_size=BLOCK, lr=1e-3,
                                 lr_tensor=None, momentum=0.9,
                                 dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                 master_mode=0, backend="native")
        else:
            OPS["lion8bit_step_"]([p], [grad], [c], [a], [], [s], qmap, block_size=BLOCK, lr=1e-4,
                                  lr_tensor=None, beta1=0.9,
                                  beta2=0.99, weight_decay=0.0, maximize=False, master_mode=0,
                                  backend="native")

    return {f"mpfused.{kind}8bit": mpfused_step, f"bnb.{kind}8bit": ob.step}


def _timed(fns: dict, warmup: int, reps: int) -> dict:
    """{name: (median wall s, median process CPU s)} of one call, round-robin."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
    for r in range(reps):
        for n in round_order(list(fns), r):
            w, c = time.perf_counter(), time.process_time()
            fns[n]()
            cpu[n].append(time.process_time() - c)
            wall[n].append(time.perf_counter() - w)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in fns}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/*.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = []
    for n in (int(s) for s in args.sizes):
        limit = n * BYTES_PER_PARAM / stream_bandwidth_at("cpu", int(n * BYTES_PER_PARAM))
        for kind in ("sgd", "lion"):
            times = _timed(_contenders(kind, n), warmup=3, reps=args.reps)
            base_wall, base_cpu = times[f"bnb.{kind}8bit"]
            for name, (wall, cpu) in times.items():
                rows.append({"numel": n, "impl": name, "ms": wall * 1e3, "cpu_ms": cpu * 1e3,
                             "vs_bnb": base_wall / wall, "cpu_vs_bnb": base_cpu / cpu,
                             "x_limit": wall / limit})
    print(machine(), "(a shared 2-core VM: other jobs run beside this one)")
    print_table(rows, ["numel", "impl", "ms", "cpu_ms", "vs_bnb", "cpu_vs_bnb", "x_limit"])
    if args.write:
        print(write_results(f"sgd-lion-8bit-{torch.get_num_threads()}t", "cpu", rows))


if __name__ == "__main__":
    main()
