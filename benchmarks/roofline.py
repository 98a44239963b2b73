"""Roofline of the native kernels: each kernel alone on one tensor (2^28 elements on a GPU) against a
device copy that moves the same bytes (CUDA events, medians), and the 10,000-small-tensor AdamW
step (host µs, GPU µs, kernel launches per step by torch.profiler) against torch's fused AdamW.

Bytes model: every operand read once and every in-place operand written once (grads are read
only): fp32 AdamW 28 B/param, bf16 + fp32 master 30, 8-bit fp32 10 (+ absmax), check bf16 2.
`fraction` = copy time / kernel time for the same bytes: 1.0 is the copy's bandwidth.

    python -m benchmarks.roofline [--device cuda] [--numel N] [--out FILE.json]
    python -m benchmarks.roofline --once --case adamw_fp32 --numel N     (one launch, for ncu)
    python -m benchmarks.roofline --ncu-csv FILE --case C --numel N --out FILE.json  (adds ncu's
        DRAM bytes per element, occupancy and shared-memory wavefronts to the JSON)
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.ops import OPS

from benchmarks.common import median_time

# name: (op, param dtype, master mode)
CASES = {
    "check_bf16": ("check_grads", torch.bfloat16, None),
    "unscale_fp32": ("unscale_grads_", torch.float32, None),
    "unscale_bf16": ("unscale_grads_", torch.bfloat16, None),
    "adamw_fp32": ("adam_step_", torch.float32, 0),
    "adamw_bf16_master": ("adam_step_", torch.bfloat16, 1),
    "adamw_bf16_remainder": ("adam_step_", torch.bfloat16, 2),
    "adamw_bf16_stochastic": ("adam_step_", torch.bfloat16, 3),
    "adamw8bit_fp32": ("adam8bit_step_", torch.float32, 0),
    "adamw8bit_bf16_master": ("adam8bit_step_", torch.bfloat16, 1),
}


BACKEND = "native"  # --backend


def make_case(name: str, n: int, device: str):
    """(call, bytes moved by the model) for one tensor of n elements."""
    op, dtype, mode = CASES[name]
    dev = torch.device(device)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    found, norm = f32(0.0), f32(0.0)
    g = torch.randn(n, device=dev).to(dtype)
    if op in ("check_grads", "unscale_grads_"):
        inv = f32(1.0)  # unscale by 1: values stay put however often it runs
        moved = g.nbytes * (2 if op == "unscale_grads_" else 1)
        return (lambda: OPS[op]([g], found, inv, None, None, backend=BACKEND)), moved
    p = (torch.randn(n, device=dev) * 0.1).to(dtype)
    masters = ([p.float()] if mode == 1 else
               [torch.zeros(n, dtype=torch.int16, device=dev)] if mode == 2 else [])
    steps = [f32(1.0)]
    tail = (None, found, norm, 0.0, 0)
    if op == "adam_step_":
        m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        moved = 2 * (p.nbytes + m.nbytes + v.nbytes + sum(x.nbytes for x in masters)) + g.nbytes
        return (lambda: OPS[op]([p], [g], [m], [v], [], masters, steps, 1e-3, None, 0.9, 0.999,
                                1e-8, 0.01, False, False, True, mode, *tail, backend=BACKEND)), moved
    block = 256
    c1, a1 = qm.quantize_blockwise(torch.zeros(n, device=dev), qm.signed_map(dev), block)
    c2, a2 = qm.quantize_blockwise(torch.zeros(n, device=dev), qm.unsigned_map(dev), block)
    q1, q2 = qm.signed_map(dev), qm.unsigned_map(dev)
    moved = 2 * (p.nbytes + c1.nbytes + c2.nbytes + a1.nbytes + a2.nbytes
                 + sum(x.nbytes for x in masters)) + g.nbytes
    return (lambda: OPS[op]([p], [g], [c1], [c2], [a1], [a2], masters, steps, q1, q2, block, 1e-3,
                            None, 0.9, 0.999, 1e-8, 0.01, False, True, mode, *tail,
                            backend=BACKEND)), moved


def kernel_rows(names, n: int, device: str, warmup: int, reps: int) -> list[dict]:
    rows = []
    for name in names:
        call, moved = make_case(name, n, device)
        t = median_time(call, device, warmup, reps)
        del call
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        tc = median_time(lambda: dst.copy_(src), device, warmup, reps)
        del src, dst
        rows.append({"case": name, "numel": n, "bytes_per_elem": moved / n, "kernel_us": t * 1e6,
                     "copy_us": tc * 1e6, "kernel_GBps": moved / t / 1e9, "copy_GBps": moved / tc / 1e9,
                     "fraction": tc / t})
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def small_step(count: int, numel: int, device: str, warmup: int, reps: int) -> list[dict]:
    """One AdamW step over `count` fp32 tensors of `numel` elements: mpfused and torch fused."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for who in ("mpfused", "torch-fused"):
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = (mpfused.AdamW(params, lr=1e-3) if who == "mpfused"
               else torch.optim.AdamW(params, lr=1e-3, fused=True))
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        host = []
        for i in range(warmup + reps):
            sync()
            t = time.perf_counter()
            opt.step()  # host time: until the call returns, launches queued
            if i >= warmup:
                host.append(time.perf_counter() - t)
        gpu = median_time(opt.step, device, 1, reps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            opt.step()
            sync()
        if device == "cuda":
            kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        else:
            kernels = None  # no device kernels on CPU: the stand-in checks the plumbing only
        rows.append({"case": f"adamw_{count}x{numel}", "who": who, "host_us": statistics.median(host) * 1e6,
                     "step_us": gpu * 1e6, "kernels_per_step": kernels})
        del opt, params
    return rows


def parse_ncu(path: Path, numel: int) -> dict:
    """ncu --csv (details page: one row per kernel x metric) -> per-kernel metric sums and DRAM
    bytes per element for the kernels named mta_kernel (the multi-tensor kernels)."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    out: dict = {}
    for r in rows:
        if "Metric Name" not in r:
            continue
        k = r.get("Kernel Name", "?").split("(")[0].split("<")[0].strip()
        try:
            val = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        out.setdefault(k, {}).setdefault(r["Metric Name"], 0.0)
        out[k][r["Metric Name"]] += val
    for k, m in out.items():
        dram = m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
        if dram:
            m["dram_bytes_per_elem"] = dram / numel
        ld = m.get("smsp__inst_executed_op_shared_ld.sum")
        if ld:
            m["shared_wavefronts_per_ld"] = m.get(
                "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", 0.0) / ld
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=lambda s: int(eval(s, {})), default=None,  # "2**28" allowed
                    help="elements per kernel (default 2**28 on cuda, 2**16 on cpu)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--small", default="10000x100", help="COUNTxNUMEL for the small-tensor step")
    ap.add_argument("--backend", default="native", help="native (the roofline's subject), triton")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", action="store_true", help="one warm-up and one launch (for ncu)")
    ap.add_argument("--case", help="with --once / --ncu-csv: the one case")
    ap.add_argument("--ncu-csv", help="parse this ncu CSV into --out")
    ap.add_argument("--out", help="JSON file (read-modify-write)")
    args = ap.parse_args(argv)
    global BACKEND
    BACKEND = args.backend
    n = args.numel or (2 ** 28 if args.device == "cuda" else 2 ** 16)
    out = Path(args.out) if args.out else None
    data = json.loads(out.read_text()) if out and out.is_file() else {}
    if args.ncu_csv:
        data.setdefault("ncu", {})[args.case] = {"numel": n, "kernels": parse_ncu(Path(args.ncu_csv), n)}
    elif args.once:
        call, _ = make_case(args.case, n, args.device)
        call()  # the warm-up launch (ncu --launch-skip 1)
        call()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return 0
    else:
        count, numel = (int(x) for x in args.small.split("x"))
        data["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        data["kernels"] = kernel_rows(args.cases.split(","), n, args.device, args.warmup, args.reps)
        data["small_step"] = small_step(count, numel, args.device, args.warmup, args.reps)
        print(f"{'case':<24}{'B/elem':>8}{'kernel us':>11}{'copy us':>10}{'GB/s':>8}{'fraction':>9}")
        for r in data["kernels"]:
            print(f"{r['case']:<24}{r['bytes_per_elem']:>8.2f}{r['kernel_us']:>11.1f}{r['copy_us']:>10.1f}"
                  f"{r['kernel_GBps']:>8.0f}{r['fraction']:>9.2f}")
        for r in data["small_step"]:
            print(f"{r['case']} {r['who']:<12} host {r['host_us']:.0f} us  step {r['step_us']:.0f} us  "
                  f"kernels {r['kernels_per_step']}")
    if out:
        out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
