"""Optimizer step and full AMP step: mpfused.AdamW against torch.optim.AdamW (fused and foreach).

* fp32 params: mpfused.AdamW vs torch AdamW(fused=True) and (foreach=True); both move 28 B/param
  (read p, g, m, v; write p, m, v).
* full AMP step (scaler + optimizer):
  native  = torch GradScaler check/unscale on fp32 grads (read+write g: 8 B) + fused AdamW (28 B)
  mpfused = read-only check on bf16 grads (2 B) + bf16 param / fp32 master step (2+2+4+4+4 read,
            2+4+4+4 write = 30 B), i.e. 32 B/param against 36.

    python benchmarks/bench_adamw.py [--device cpu|cuda] [--totals 1000000,10000000] [--counts 1,100,10000]
"""
from __future__ import annotations

import argparse

import torch

import mpfused
from benchmarks.common import stream_bandwidth_at, print_table, side_by_side, split_sizes, write_results

BYTES = {"fp32_step": 28, "native_amp": 36, "mpfused_amp": 32}


def params_for(sizes, dtype, device):
    ps = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def amp_step(scaler, opt):
    scaler.scale(torch.ones((), device=scaler._scale.device if scaler._scale is not None else "cpu"))
    scaler.step(opt)
    scaler.update()


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
            sizes = split_sizes(total, count)
            row = {"params": total, "tensors": count}
            # stream bandwidth at this step's working set (the same cache level)
            bw = stream_bandwidth_at(dev, BYTES["fp32_step"] * total)
            row["stream_GBps"] = bw / 1e9
            # fp32 optimizer step alone, the three contenders timed side by side
            opts = {
                "torch_fused": torch.optim.AdamW(params_for(sizes, torch.float32, dev), lr=1e-4, fused=True),
                "torch_foreach": torch.optim.AdamW(params_for(sizes, torch.float32, dev), lr=1e-4, foreach=True),
                "mpfused": mpfused.AdamW(params_for(sizes, torch.float32, dev), lr=1e-4),
            }
            t = side_by_side({n: o.step for n, o in opts.items()}, dev)
            for name in opts:
                row[f"{name}_fp32_ms"] = t[name] * 1e3
            del opts
            row["fp32_speedup_vs_fused"] = row["torch_fused_fp32_ms"] / row["mpfused_fp32_ms"]
            row["mpfused_fp32_bw_frac"] = BYTES["fp32_step"] * total / (row["mpfused_fp32_ms"] / 1e3) / bw
            # full AMP step: scaler + optimizer
            native_opt = torch.optim.AdamW(params_for(sizes, torch.float32, dev), lr=1e-4, fused=True)
            native_scaler = torch.amp.GradScaler(dev, init_scale=1.0, growth_interval=10**9)
            ours_opt = mpfused.AdamW(params_for(sizes, torch.bfloat16, dev), lr=1e-4)
            ours_scaler = mpfused.GradScaler(dev, init_scale=1.0, growth_interval=10**9)
            t = side_by_side({"native": lambda: amp_step(native_scaler, native_opt),
                              "mpfused": lambda: amp_step(ours_scaler, ours_opt)}, dev)
            row["native_amp_ms"] = t["native"] * 1e3
            row["mpfused_amp_ms"] = t["mpfused"] * 1e3
            row["amp_speedup"] = row["native_amp_ms"] / row["mpfused_amp_ms"]
            row["mpfused_amp_bw_frac"] = BYTES["mpfused_amp"] * total / (row["mpfused_amp_ms"] / 1e3) / bw
            rows.append(row)
            print_table([row], list(row))
    print(f"\nstream bandwidth at each step's working set: stream_GBps ({dev}); bytes/param model: "
          f"{BYTES}")
    print_table(rows, list(rows[0]))
    print(write_results("adamw", dev, rows, {"bytes_per_param": BYTES}))


if __name__ == "__main__":
    main()
