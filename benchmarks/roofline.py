"""Roofline of the native kernels: each kernel alone on one tensor (2^28 elements on a GPU) against a
device copy that moves the same bytes (CUDA events, medians), and the 10,000-small-tensor step of
each optimizer family (host us, GPU us, kernel launches per step and per kernel name by
torch.profiler: the 8-bit / 4-bit prepare launches (Adam, SGD, Lion) show as prepare_kernel) against
torch's fused step where torch has one.

Bytes model: every operand read once and every in-place operand written once (grads are read
only), counted from the tensors' sizes: fp32 AdamW 28 B/param, bf16 + fp32 master 30, 8-bit fp32
16 (+ absmax), 4-bit fp32 14 (+ absmax), check bf16 2; SGD without momentum 12 (read p, g; write p), SGD with momentum 20
(read p, g, buf; write p, buf), Lion 20 (read p, g, m; write p, m); bf16 params with an fp32
master: SGD 14 / SGD momentum 22 / Lion 22 (a 2-byte param and a 4-byte master, each read and
written, a 2-byte grad); 8-bit SGD / Lion fp32 14 (+ absmax), 4-bit SGD / Lion fp32 13 (+ absmax).
`fraction` = copy time / kernel time for the same bytes: 1.0 is the copy's bandwidth. A case
whose op has no native kernel on the device (an extension built without it) is listed as
skipped.

    python -m benchmarks.roofline [--device cuda] [--numel N] [--out FILE.json]
    python -m benchmarks.roofline --once --case adamw_fp32 --numel N     (one launch, for ncu)
    python -m benchmarks.roofline --ncu-csv FILE --case C --numel N --out FILE.json  (adds ncu's
        DRAM bytes per element, occupancy, stall reasons and shared-memory wavefronts to the JSON)
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

# name: (op, param dtype, master mode[, SGD momentum])
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
    "adamw4bit_fp32": ("adam4bit_step_", torch.float32, 0),
    "adamw4bit_bf16_master": ("adam4bit_step_", torch.bfloat16, 1),
    "sgd_fp32": ("sgd_step_", torch.float32, 0, 0.0),
    "sgd_momentum_fp32": ("sgd_step_", torch.float32, 0, 0.9),
    "sgd_momentum_bf16_master": ("sgd_step_", torch.bfloat16, 1, 0.9),
    "lion_fp32": ("lion_step_", torch.float32, 0),
    "lion_bf16_master": ("lion_step_", torch.bfloat16, 1),
    "sgd8bit_fp32": ("sgd8bit_step_", torch.float32, 0, 0.9),
    "lion8bit_fp32": ("lion8bit_step_", torch.float32, 0),
    "sgd4bit_fp32": ("sgd4bit_step_", torch.float32, 0, 0.9),
    "lion4bit_fp32": ("lion4bit_step_", torch.float32, 0),
}


BACKEND = "native"  # --backend


def make_case(name: str, n: int, device: str):
    """(call, bytes moved by the model) for one tensor of n elements."""
    op, dtype, mode, *momentum = CASES[name]
    dev = torch.device(device)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    found, norm = f32(0.0), f32(0.0)
    g = torch.randn(n, device=dev).to(dtype)
    if op in ("check_grads", "unscale_grads_"):
        inv = f32(1.0)  # unscale by 1: values stay put however often it runs
        moved = g.nbytes * (2 if op == "unscale_grads_" else 1)
        return (lambda: OPS[op]([g], found, inv, backend=BACKEND)), moved
    p = (torch.randn(n, device=dev) * 0.1).to(dtype)
    masters = ([p.float()] if mode == 1 else
               [torch.zeros(n, dtype=torch.int16, device=dev)] if mode == 2 else [])
    steps = [f32(1.0)]
    tail = dict(master_mode=mode, grad_scale=None, found_inf=found, norm_sq=norm,
                max_grad_norm=0.0, seed=0)
    if op == "adam_step_":
        m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        moved = 2 * (p.nbytes + m.nbytes + v.nbytes + sum(x.nbytes for x in masters)) + g.nbytes
        return (lambda: OPS[op]([p], [g], [m], [v], [], masters, steps, lr=1e-3, lr_tensor=None,
                                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                amsgrad=False, maximize=False, decoupled=True, **tail,
                                backend=BACKEND)), moved
    if op in ("sgd_step_", "lion_step_"):
        st = [torch.zeros(n, device=dev)] if momentum != [0.0] else []
        moved = 2 * (p.nbytes + sum(x.nbytes for x in st + masters)) + g.nbytes
        if op == "sgd_step_":
            return (lambda: OPS[op]([p], [g], st, masters, steps, lr=1e-3, lr_tensor=None,
                                    momentum=momentum[0], dampening=0.0, weight_decay=0.0,
                                    nesterov=False, maximize=False, **tail,
                                    backend=BACKEND)), moved
        return (lambda: OPS[op]([p], [g], st, masters, steps, lr=1e-4, lr_tensor=None, beta1=0.9,
                                beta2=0.99, weight_decay=0.0, maximize=False, **tail,
                                backend=BACKEND)), moved
    block = 256
    if op in ("sgd8bit_step_", "lion8bit_step_", "sgd4bit_step_", "lion4bit_step_"):
        q, quantize = qm.signed_map(dev), qm.quantize_blockwise
        if op.endswith("4bit_step_"):  # 16-entry map, two codes per byte
            from mpfused import quant4
            q, quantize = quant4.signed4_map(dev), quant4.quantize4_blockwise
        c, a = quantize(torch.zeros(n, device=dev), q, block)
        moved = 2 * (p.nbytes + c.nbytes + a.nbytes + sum(x.nbytes for x in masters)) + g.nbytes
        head = ([p], [g], [c], [a], masters, steps, q)
        hyper = (dict(lr=1e-3, lr_tensor=None, momentum=0.9, dampening=0.0, weight_decay=0.0,
                      nesterov=False, maximize=False) if op.startswith("sgd")
                 else dict(lr=1e-4, lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=0.0,
                           maximize=False))
        return (lambda: OPS[op](*head, block_size=block, **hyper, **tail,
                                backend=BACKEND)), moved
    # adam8bit_step_ / adam4bit_step_ (one schema; 4-bit: 16-entry maps, two codes per byte)
    q1, q2, quantize = qm.signed_map(dev), qm.unsigned_map(dev), qm.quantize_blockwise
    if op == "adam4bit_step_":
        from mpfused import quant4
        q1, q2, quantize = quant4.signed4_map(dev), quant4.unsigned4_map(dev), quant4.quantize4_blockwise
    c1, a1 = quantize(torch.zeros(n, device=dev), q1, block)
    c2, a2 = quantize(torch.zeros(n, device=dev), q2, block)
    moved = 2 * (p.nbytes + c1.nbytes + c2.nbytes + a1.nbytes + a2.nbytes
                 + sum(x.nbytes for x in masters)) + g.nbytes
    return (lambda: OPS[op]([p], [g], [c1], [c2], [a1], [a2], masters, steps, q1, q2,
                            block_size=block, lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999,
                            eps=1e-8, weight_decay=0.01, maximize=False, decoupled=True, **tail,
                            backend=BACKEND)), moved


def kernel_rows(names, n: int, device: str, warmup: int, reps: int) -> list[dict]:
    rows = []
    for name in names:
        if BACKEND not in OPS[CASES[name][0]].available(device):
            rows.append({"case": name, "numel": n, "skipped": f"no {BACKEND} {CASES[name][0]} on {device}"})
            continue
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


# family -> who -> optimizer factory, for the many-small-tensor step
SMALL = {
    "adamw": {"mpfused": lambda ps: mpfused.AdamW(ps, lr=1e-3),
              "torch-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)},
    "sgd": {"mpfused": lambda ps: mpfused.SGD(ps, lr=1e-3, momentum=0.9),
            "torch-fused": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)},
    "lion": {"mpfused": lambda ps: mpfused.Lion(ps, lr=1e-4)},
    # min_8bit_size=1: the small tensors get 8-bit state too (default: fp32 below 4096 elements)
    "adamw8bit": {"mpfused": lambda ps: mpfused.AdamW8bit(ps, lr=1e-3, min_8bit_size=1)},
    "adamw4bit": {"mpfused": lambda ps: mpfused.AdamW4bit(ps, lr=1e-3, min_8bit_size=1)},
    "sgd8bit": {"mpfused": lambda ps: mpfused.SGD8bit(ps, lr=1e-3, momentum=0.9, min_8bit_size=1)},
    "lion8bit": {"mpfused": lambda ps: mpfused.Lion8bit(ps, lr=1e-4, min_8bit_size=1)},
    "sgd4bit": {"mpfused": lambda ps: mpfused.SGD4bit(ps, lr=1e-3, momentum=0.9, min_8bit_size=1)},
    "lion4bit": {"mpfused": lambda ps: mpfused.Lion4bit(ps, lr=1e-4, min_8bit_size=1)},
}


def small_step(count: int, numel: int, device: str, warmup: int, reps: int,
               families=tuple(SMALL)) -> list[dict]:
    """One step over `count` fp32 tensors of `numel` elements, per family: mpfused and torch
    fused. Kernel launches per step by name: the 8-bit prepare kernels are among them."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    rows = []
    for fam in families:
        for who, make in SMALL[fam].items():
            params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = make(params)
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
                names = Counter(_short(e.name) for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA)
                kernels, by_name = sum(names.values()), dict(names.most_common(8))
            else:
                kernels, by_name = None, None  # no device kernels on CPU: the plumbing only
            rows.append({"case": f"{fam}_{count}x{numel}", "who": who,
                         "host_us": statistics.median(host) * 1e6, "step_us": gpu * 1e6,
                         "kernels_per_step": kernels, "kernels_by_name": by_name})
            del opt, params
    return rows


def _short(name: str) -> str:
    """A kernel's name without its arguments and namespaces: 'mta_kernel<...>', 'prepare_kernel<448>'."""
    return name.split("(")[0].replace("void ", "").split("::")[-1][:60]


def parse_ncu(path: Path, numel: int) -> dict:
    """ncu --csv (details page: one row per kernel x metric) -> per-kernel metric sums (one launch
    of each kernel is profiled), DRAM bytes per element, shared-memory wavefronts per load and the
    top stall reasons (cycles per issued instruction) for the profiled kernels (mta_kernel, and
    the 8-bit prepare_kernel); "all kernels": the DRAM bytes per element of the whole call."""
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
        stalls = {name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: v for name, v in m.items()
                  if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX)}
        if stalls:
            m["stall_top"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
    dram = [m["dram_bytes_per_elem"] for m in out.values() if "dram_bytes_per_elem" in m]
    if len(out) > 1 and dram:
        out["all kernels"] = {"dram_bytes_per_elem": sum(dram)}
    return out


# ncu's WarpStateStats stall reasons, as metrics (gpu_suite.sh asks for them by name)
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "lg_throttle", "wait",
          "math_pipe_throttle", "not_selected", "selected", "no_instruction", "drain", "membar",
          "dispatch_stall", "branch_resolving", "imc_miss", "sleeping", "tex_throttle")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=lambda s: int(eval(s, {})), default=None,  # "2**28" allowed
                    help="elements per kernel (default 2**28 on cuda, 2**16 on cpu)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--small", default="10000x100", help="COUNTxNUMEL for the small-tensor step")
    ap.add_argument("--small-families", default=",".join(SMALL), help="optimizer families of the small step")
    ap.add_argument("--backend", default="native", help="native (the roofline's subject), triton")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", action="store_true", help="one warm-up and one launch (for ncu)")
    ap.add_argument("--case", help="with --once / --ncu-csv: the one case")
    ap.add_argument("--ncu-csv", help="parse this ncu CSV into --out")
    ap.add_argument("--stall-metrics", action="store_true", help="print ncu's stall-reason metric names")
    ap.add_argument("--out", help="JSON file (read-modify-write)")
    args = ap.parse_args(argv)
    global BACKEND
    BACKEND = args.backend
    n = args.numel or (2 ** 28 if args.device == "cuda" else 2 ** 16)
    out = Path(args.out) if args.out else None
    data = json.loads(out.read_text()) if out and out.is_file() else {}
    if args.stall_metrics:
        print(",".join(STALL_PREFIX + r + STALL_SUFFIX for r in STALLS))
        return 0
    if args.ncu_csv:
        data.setdefault("ncu", {})[args.case] = {"numel": n, "kernels": parse_ncu(Path(args.ncu_csv), n)}
    elif args.once:
        if BACKEND not in OPS[CASES[args.case][0]].available(args.device):
            print(f"skipped: no {BACKEND} {CASES[args.case][0]} on {args.device}")
            return 0
        call, _ = make_case(args.case, n, args.device)
        call()  # the warm-up call (ncu --launch-skip: its launches)
        call()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return 0
    else:
        count, numel = (int(x) for x in args.small.split("x"))
        data["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        data["kernels"] = kernel_rows(args.cases.split(","), n, args.device, args.warmup, args.reps)
        data["small_step"] = small_step(count, numel, args.device, args.warmup, args.reps,
                                        args.small_families.split(","))
        print(f"{'case':<24}{'B/elem':>8}{'kernel us':>11}{'copy us':>10}{'GB/s':>8}{'fraction':>9}")
        for r in data["kernels"]:
            if "skipped" in r:
                print(f"{r['case']:<24} skipped: {r['skipped']}")
                continue
            print(f"{r['case']:<24}{r['bytes_per_elem']:>8.2f}{r['kernel_us']:>11.1f}{r['copy_us']:>10.1f}"
                  f"{r['kernel_GBps']:>8.0f}{r['fraction']:>9.2f}")
        for r in data["small_step"]:
            print(f"{r['case']} {r['who']:<12} host {r['host_us']:.0f} us  step {r['step_us']:.0f} us  "
                  f"kernels {r['kernels_per_step']} {r['kernels_by_name'] or ''}")
    if out:
        out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
