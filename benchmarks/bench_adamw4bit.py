"""CPU step time of mpfused.AdamW4bit side by side, in one process, with torch's fused fp32 AdamW,
torchao's AdamW4bit (on CPU: torch.compile'd per param) and mpfused.AdamW8bit; with --one-state
also mpfused's SGD4bit / Lion4bit (momentum / moment as 4-bit codes) and their 8-bit forms.

One fp32 param of each size, the grad fixed (the work per step is the same), each optimizer's
step() as a user calls it; the master-weight rows (``+remainder``: int16 low half of the fp32
master, ``+remainder8``: int8 correction, a 24-bit master) keep a bf16 param and grad instead. Timing: warm-up (torchao compiles here), then the contenders take
turns (benchmarks.common.round_order); medians of the wall time and of the process CPU time of
one step. Ratios: ``vs_torch`` = torch fused fp32 time / this time (>= 0.67 meets the goal
"<= 1.5x torch fused"), ``vs_torchao4`` = torchao 4-bit time / this time (goal >= 10 for ours);
``ns_per_param`` = wall time / numel.
Also the step over the bytes it moves (param r/w, grad, masters r/w, codes r/w, absmax: 12 + 2 x
(2 x 0.5 + 8 / 128) B/param for 4-bit) at the measured stream bandwidth of the working set
(x_limit). The load average is recorded beside the results (the machine is shared).
Not a test:
    python -m benchmarks.bench_adamw4bit [--sizes 1e6 1e7] [--reps 21] [--threads N] [--one-state]
        [--load-note TEXT] [--write]
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
import mpfused  # noqa: E402

BYTES_PER_PARAM = {"4bit": 12 + 2 * (1 + 8 / 128), "8bit": 12 + 2 * (2 + 8 / 256), "fp32": 12 + 16,
                   "4bit1": 12 + 1 + 4 / 128, "8bit1": 12 + 2 + 4 / 256}  # 1: one state (SGD, Lion)
# bf16 param r/w + grad (6 B) + masters r/w instead of the fp32 param's 12 B
MASTER_BYTES = {"remainder": 6 + 4, "remainder8": 6 + 2}


def _contenders(n: int, with_torchao: bool, one_state: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g) * 0.02
    grad = torch.randn(n, generator=g) * 1e-3

    def make(build, dtype=torch.float32):
        p = torch.nn.Parameter(p0.to(dtype))
        p.grad = grad.to(dtype)
        return build([p]).step

    def ours(cls, master=None, **kw):
        if master is None:
            return make(lambda ps: cls(ps, lr=1e-3, min_8bit_size=0, **kw))
        return make(lambda ps: cls(ps, lr=1e-3, min_8bit_size=0, master_weights=master, **kw),
                    torch.bfloat16)

    fns = {
        "torch.AdamW(fused)": make(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "mpfused.AdamW8bit": ours(mpfused.AdamW8bit),
        "mpfused.AdamW8bit+remainder": ours(mpfused.AdamW8bit, "remainder"),
        "mpfused.AdamW8bit+remainder8": ours(mpfused.AdamW8bit, "remainder8"),
        "mpfused.AdamW4bit": ours(mpfused.AdamW4bit),
        "mpfused.AdamW4bit+remainder8": ours(mpfused.AdamW4bit, "remainder8"),
    }
    if one_state:
        fns.update({
            "mpfused.SGD8bit": ours(mpfused.SGD8bit, momentum=0.9),
            "mpfused.SGD4bit": ours(mpfused.SGD4bit, momentum=0.9),
            "mpfused.Lion8bit": ours(mpfused.Lion8bit),
            "mpfused.Lion4bit": ours(mpfused.Lion4bit),
            "mpfused.Lion8bit+remainder8": ours(mpfused.Lion8bit, "remainder8"),
            "mpfused.Lion4bit+remainder8": ours(mpfused.Lion4bit, "remainder8"),
        })
    if with_torchao:
        from torchao.optim import AdamW4bit
        fns["torchao.AdamW4bit"] = make(lambda ps: AdamW4bit(ps, lr=1e-3))
    return fns


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
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--one-state", action="store_true", help="also SGD / Lion 4-bit and 8-bit")
    ap.add_argument("--load-note", default=None, help="what else ran on the machine (recorded)")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/*.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = []
    for n in (int(s) for s in args.sizes):
        times = _timed(_contenders(n, not args.no_torchao, args.one_state), warmup=3,
                       reps=args.reps)
        base_wall, base_cpu = times["torch.AdamW(fused)"]
        ao = times.get("torchao.AdamW4bit")
        for name, (wall, cpu) in times.items():
            kind = "4bit" if "4bit" in name else "8bit" if "8bit" in name else "fp32"
            kind += "1" if ("SGD" in name or "Lion" in name) else ""
            master = name.rpartition("+")[2] if "+" in name else None
            moved = n * (BYTES_PER_PARAM[kind] - (12 - MASTER_BYTES[master] if master else 0))
            rows.append({"numel": n, "impl": name, "ms": wall * 1e3, "cpu_ms": cpu * 1e3,
                         "ns_per_param": wall * 1e9 / n,
                         "vs_torch": base_wall / wall, "cpu_vs_torch": base_cpu / cpu,
                         "vs_torchao4": ao[0] / wall if ao else None,
                         "x_limit": wall / (moved / stream_bandwidth_at("cpu", int(moved)))})
    load = os.getloadavg()
    print(machine(), "(a shared 2-core VM: other jobs run beside this one); load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end")
    print_table(rows, ["numel", "impl", "ms", "cpu_ms", "ns_per_param", "vs_torch", "cpu_vs_torch", "vs_torchao4",
                       "x_limit"])
    if args.write:
        print(write_results(f"adamw4bit-{torch.get_num_threads()}t", "cpu", rows,
                            {"load_average_1_5_15min": [round(x, 2) for x in load],
                             "load_note": args.load_note}))


if __name__ == "__main__":
    main()
