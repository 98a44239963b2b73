"""Optimizer step: mpfused.SGD / Lion (and their 8-bit classes, where present) side by side with
torch.optim.SGD (fused and foreach) and bitsandbytes' Lion / Lion8bit / SGD8bit, fp32 params.

Bytes moved per param (model): SGD + momentum 20 (read p, g, buf; write p, buf); SGD without
momentum 12; Lion 20 (read p, g, m; write p, m); 8-bit state: the state costs 2 B (read and write
one code) + 8/block for its absmax instead of 8.

    python benchmarks/bench_sgd_lion.py [--device cpu|cuda] [--totals 1000000,10000000] \
        [--counts 1,100,10000]
"""
from __future__ import annotations

import argparse

import torch

import mpfused
from benchmarks.common import (print_table, side_by_side, split_sizes, stream_bandwidth_at,
                               write_results)

BYTES = {"sgd_momentum": 20, "lion": 20, "8bit_state": 14}


def params_for(sizes, device):
    ps = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _bnb():
    try:
        import bitsandbytes.optim as bnb
        return bnb
    except Exception:  # not installed, or no backend for this device
        return None


def contenders(sizes, dev):
    """name -> a zero-argument step, for SGD + momentum and for Lion."""
    sgd = dict(lr=1e-3, momentum=0.9)
    lion = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    opts = {
        "sgd/torch_fused": torch.optim.SGD(params_for(sizes, dev), fused=True, **sgd),
        "sgd/torch_foreach": torch.optim.SGD(params_for(sizes, dev), foreach=True, **sgd),
        "sgd/mpfused": mpfused.SGD(params_for(sizes, dev), **sgd),
        "lion/mpfused": mpfused.Lion(params_for(sizes, dev), **lion),
    }
    for name, cls in (("sgd/mpfused_8bit", "SGD8bit"), ("lion/mpfused_8bit", "Lion8bit")):
        if hasattr(mpfused, cls):
            kw = sgd if name.startswith("sgd") else lion
            opts[name] = getattr(mpfused, cls)(params_for(sizes, dev), **kw)
    bnb = _bnb()
    if bnb is not None:
        opts["lion/bnb_32bit"] = bnb.Lion(params_for(sizes, dev), optim_bits=32, **lion)
        opts["lion/bnb_8bit"] = bnb.Lion8bit(params_for(sizes, dev), **lion)
        opts["sgd/bnb_8bit"] = bnb.SGD8bit(params_for(sizes, dev), **sgd)
    return opts


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--totals", default="1000000,10000000")
    ap.add_argument("--counts", default="1,100,10000")
    args = ap.parse_args(argv)
    dev = args.device
    rows = []
    for total in map(int, args.totals.split(",")):
        for count in map(int, args.counts.split(",")):
            row = {"params": total, "tensors": count}
            bw = stream_bandwidth_at(dev, BYTES["sgd_momentum"] * total)
            row["stream_GBps"] = bw / 1e9
            opts = contenders(split_sizes(total, count), dev)
            t = side_by_side({n: o.step for n, o in opts.items()}, dev)  # timed in one rotation
            for name in opts:
                row[f"{name}_ms"] = t[name] * 1e3
            del opts
            row["sgd_speedup_vs_torch_fused"] = row["sgd/torch_fused_ms"] / row["sgd/mpfused_ms"]
            row["sgd_mpfused_bw_frac"] = (BYTES["sgd_momentum"] * total
                                          / (row["sgd/mpfused_ms"] / 1e3) / bw)
            for fam, ours, theirs in (("lion", "lion/mpfused", "lion/bnb_32bit"),
                                      ("lion8", "lion/mpfused_8bit", "lion/bnb_8bit"),
                                      ("sgd8", "sgd/mpfused_8bit", "sgd/bnb_8bit")):
                if f"{ours}_ms" in row and f"{theirs}_ms" in row:
                    row[f"{fam}_speedup_vs_bnb"] = row[f"{theirs}_ms"] / row[f"{ours}_ms"]
            rows.append(row)
            print_table([row], list(row))
    print(f"\nbytes/param model: {BYTES}")
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("params", "tensors"), k))
    print_table(rows, columns)
    print(write_results("sgd-lion", dev, rows, {"bytes_per_param": BYTES}))


if __name__ == "__main__":
    main()
