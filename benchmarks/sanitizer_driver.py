"""The workload for compute-sanitizer (memcheck, racecheck, synccheck, initcheck) in gpu_suite.sh:
every op of every backend once, on every case of the smoke test (benchmarks/smoke_cases.py: each
dtype and master mode, SGD's plain / momentum / Nesterov variants; odd sizes, a tensor one element
past an aligned start and a transposed one), the 8-bit and 4-bit steps (Adam, SGD, Lion) at every
block-size class (within a warp, one warp, several warps, a whole 4096 chunk), and
per optimizer
family two extra calls:
  * many tensors (MANY, 1-7 elements each; native only): more than one launch of the multi-tensor kernel and,
    for the 8-bit / 4-bit steps (Adam, SGD, Lion), of their prepare kernel (3,584 tensors per prepare
    launch with 32 KB kernel parameters, 448 with 4 KB), whose workspace the main kernel then
    reads per tensor;
  * a skipped step (found_inf > 0): the prepare writes nothing into the fresh workspace, so a main
    kernel that read it anyway would show under initcheck.
Every op has a native CUDA kernel; one with no kernel for a backend on the device (an extension
built without it, Triton missing) is skipped and named on the last line.

Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1: under the caching allocator an out-of-bounds access
that lands in the same cached segment is invisible to memcheck. Progress goes to stdout per op
family (flushed), so a run cut by its time cap still says which families finished clean.
    python -m benchmarks.sanitizer_driver [--device cuda] [--backends native,triton] [--only FAMILIES]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import mpfused  # noqa: F401
from benchmarks.gpu_smoke import _to
from benchmarks.smoke_cases import FAMILIES, cases, inputs
from mpfused.ops import OPS

BLOCKS_8BIT = (64, 128, 256, 4096)
EIGHT_BIT = ("adam8bit_step_", "adam4bit_step_", "sgd8bit_step_", "lion8bit_step_",  # block-wise
             "sgd4bit_step_", "lion4bit_step_")
OPTIMIZERS = ("adam_step_", "sgd_step_", "lion_step_") + EIGHT_BIT
MANY = 3600  # > 3,584: two prepare launches even with 32 KB parameters


def calls(op: str, backend: str, dtype: str, mode: str, first: bool):
    """(label, block, count, found_inf) for one case; the extra calls ride on a family's first
    case per backend."""
    out = [("", b, 0, 0.0) for b in (BLOCKS_8BIT if op in EIGHT_BIT else (256,))]
    # many tensors: the native kernels pack them into few launches (Triton launches per tensor)
    if first and backend == "native" and (op in OPTIMIZERS or op in ("check_grads", "unscale_grads_")):
        out.append((f" x{MANY}", 256, MANY, 0.0))
    if first and op in OPTIMIZERS:
        out.append((" skipped-step", 256, 0, 1.0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="native,triton")
    ap.add_argument("--only", default=",".join(FAMILIES))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    only = args.only.split(",")
    n, skipped, seen, done = 0, set(), [], 0
    t0 = time.perf_counter()

    def family_done():
        if args.device == "cuda":
            torch.cuda.synchronize()  # a fault is reported against this family, not a later one
        print(f"sanitizer driver: {seen[-1][0]} {seen[-1][1]}: {done} calls done", flush=True)

    for op, backend, dtype, mode in cases(args.backends.split(",")):
        if op not in only:
            continue
        if backend not in OPS[op].available(args.device):
            skipped.add(f"{op} {backend}")
            continue
        first = (op, backend) not in seen
        if first:
            if seen:
                family_done()
            seen.append((op, backend))
            done = 0
        for _label, block, count, found_inf in calls(op, backend, dtype, mode, first):
            a, kw, _ = inputs(op, dtype, mode, gen, block=block, count=count, found_inf=found_inf)
            OPS[op](*_to(a, args.device), **_to(kw, args.device), backend=backend)
            n += 1
            done += 1
    if seen:
        family_done()
    note = f"; skipped, no kernel on {args.device}: {', '.join(sorted(skipped))}" if skipped else ""
    print(f"sanitizer driver: {n} calls on {args.device} ({args.backends}; {args.only}) in "
          f"{time.perf_counter() - t0:.0f} s: ok{note}", flush=True)
    return 0 if n or skipped else 1  # all skipped (no Triton here): said above, not a failure


if __name__ == "__main__":
    sys.exit(main())
