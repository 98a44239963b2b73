"""The workload for compute-sanitizer (memcheck, racecheck, synccheck, initcheck) in gpu_suite.sh:
every op of every backend once, on every case of the smoke test (each dtype and master mode;
odd sizes, a tensor one element past an aligned start and a transposed one), and the 8-bit step
at every block-size class (within a warp, one warp, several warps, a whole 4096 chunk).

Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1: under the caching allocator an out-of-bounds access
that lands in the same cached segment is invisible to memcheck.
    python -m benchmarks.sanitizer_driver [--device cuda] [--backends native,triton] [--only FAMILIES]
"""
from __future__ import annotations

import argparse
import sys

import torch

import mpfused  # noqa: F401
from benchmarks.gpu_smoke import FAMILIES, _inputs, _to, cases
from mpfused.ops import OPS

BLOCKS_8BIT = (64, 128, 256, 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="native,triton")
    ap.add_argument("--only", default=",".join(FAMILIES))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    n = 0
    for op, backend, dtype, mode in cases(args.backends.split(",")):
        if op not in args.only.split(",") or backend not in OPS[op].available(args.device):
            continue
        for block in (BLOCKS_8BIT if op == "adam8bit_step_" else (256,)):
            a, kw, _ = _inputs(op, dtype, mode, gen, block=block)
            OPS[op](*_to(a, args.device), **_to(kw, args.device), backend=backend)
            n += 1
    if args.device == "cuda":
        torch.cuda.synchronize()
    print(f"sanitizer driver: {n} calls on {args.device} ({args.backends}; {args.only}): ok")
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
