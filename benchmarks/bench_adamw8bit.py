"""Step time of 8-bit AdamW implementations on CPU or CUDA, their optimizer-state bytes per
parameter, and how close each step comes to the bytes it must move.

Compares mpfused.AdamW8bit (native kernel) with bitsandbytes.optim.AdamW8bit,
torchao.optim.AdamW8bit, torch.optim.AdamW(fused=True) (fp32 state: the speed reference) and
mpfused.AdamW (fp32 state). Each model size is a list of 512x512 fp32 weights plus a 512-element
bias per weight (biases are below min_8bit_size and keep fp32 state everywhere). Grads are set
once; every optimizer runs `--warmup` steps (torchao compiles there), then the optimizers take
turns (`--rounds` rounds of `--steps` steps each, the order changing every round as in
benchmarks.common.round_order, so a change of machine load or cache contents hits all of them)
and the median step time is reported: wall time of `opt.step()` (CUDA: synchronized before and
after, so host work and launches count, bitsandbytes' per-parameter syncs included), with the
median process CPU time per step (CPU: all threads; steadier than wall time on a shared machine,
exact with --threads 1). Bytes/param counts each distinct state tensor once, for the large
(8-bit) tensors only and for the whole model. The bytes-moved limit of a step is the bytes it
must read and write (fp32 param read + write, grad read, state read + write: 16.06 B/param with
8-bit state and 256-element blocks, 28 with fp32 state) over the measured stream bandwidth (common.stream_bandwidth_at);
`x_limit` is the step time over that limit.

Writes benchmarks/results/bench_adamw8bit_<device>_<date>.{json,csv}. Not a test:
    python -m benchmarks.bench_adamw8bit [--device cpu|cuda] [--sizes 1e6 1e7]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

if __package__ in (None, ""):  # run as a script: python benchmarks/bench_adamw8bit.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import stream_bandwidth_at, round_order  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BLOCK = 256  # the state block of all three 8-bit optimizers (their defaults)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _moved_bytes_per_param(name: str) -> float:
    """Bytes a step must read and write per fp32 param: param read + write (8), grad read (4),
    and the two moments read + written, 8-bit codes (+ one fp32 absmax each per block) or fp32."""
    if "8bit" in name:
        return 8 + 4 + 2 * 2 * (1 + 4 / BLOCK)
    return 8 + 4 + 2 * 2 * 4


def _model(numel: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = max(1, round(numel / (512 * 512 + 512)))
    params = []
    for _ in range(k):
        params.append(torch.nn.Parameter((torch.randn(512, 512, generator=g) * 0.02).to(device)))
        params.append(torch.nn.Parameter(torch.zeros(512, device=device)))
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    return params


def _p10(times: list) -> float:
    return statistics.quantiles(times, n=10)[0] if len(times) > 1 else times[0]


def _timed_step(opt, device: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one opt.step()."""
    if device == "cuda":
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def _inner_tensors(t: torch.Tensor):
    """A state tensor, or the plain tensors inside a tensor subclass (torchao OptimState8bit)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _inner_tensors(getattr(t, name))
    else:
        yield t


def _state_bytes(opt, params) -> int:
    seen, total = set(), 0
    for p in params:
        for v in opt.state.get(p, {}).values():
            if not isinstance(v, torch.Tensor):
                continue
            for t in _inner_tensors(v):
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


def _optimizers():
    import mpfused
    makers = {
        "mpfused.AdamW8bit": lambda ps: mpfused.AdamW8bit(ps, lr=1e-3),
        "torch.AdamW(fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "mpfused.AdamW": lambda ps: mpfused.AdamW(ps, lr=1e-3),
    }
    try:
        import bitsandbytes as bnb
        makers["bnb.AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except Exception as exc:  # noqa: BLE001  (optional peer)
        warnings.warn(f"bitsandbytes unavailable: {exc}")
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit
        makers["torchao.AdamW8bit"] = lambda ps: AoAdamW8bit(ps, lr=1e-3)
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"torchao unavailable: {exc}")
    return makers


def bench(sizes, steps, rounds, warmup, device):
    makers = _optimizers()
    rows = []
    for size in sizes:
        runs = {}
        for name, make in makers.items():
            params = _model(size, device)
            opt = make(params)
            t0 = time.perf_counter()
            for _ in range(warmup):
                _timed_step(opt, device)
            runs[name] = dict(params=params, opt=opt, times=[], cpu=[],
                              warmup_s=time.perf_counter() - t0)
        for r in range(rounds):
            for name in round_order(list(runs), r):
                for _ in range(steps):
                    wall, cpu = _timed_step(runs[name]["opt"], device)
                    runs[name]["times"].append(wall)
                    runs[name]["cpu"].append(cpu)
        numel = sum(p.numel() for p in runs["torch.AdamW(fused)"]["params"])
        ref = statistics.median(runs["torch.AdamW(fused)"]["times"])
        ref_cpu = statistics.median(runs["torch.AdamW(fused)"]["cpu"])
        for name, r in runs.items():
            med = statistics.median(r["times"])
            big = [p for p in r["params"] if p.dim() == 2]
            # stream bandwidth at this optimizer's working set (the same cache level)
            bandwidth = stream_bandwidth_at(device, numel * _moved_bytes_per_param(name))
            limit = numel * _moved_bytes_per_param(name) / bandwidth
            rows.append(dict(
                optimizer=name, device=device, params=numel, tensors=len(r["params"]),
                median_ms=med * 1e3, p10_ms=_p10(r["times"]) * 1e3,
                mparam_per_s=numel / med / 1e6, vs_torch_fused=med / ref,
                cpu_ms=statistics.median(r["cpu"]) * 1e3,
                cpu_vs_torch_fused=statistics.median(r["cpu"]) / ref_cpu,
                moved_bytes_per_param=_moved_bytes_per_param(name), limit_ms=limit * 1e3,
                x_limit=med / limit, stream_bandwidth_GBps=bandwidth / 1e9,
                state_bytes_per_param_large=_state_bytes(r["opt"], big) / sum(p.numel() for p in big),
                state_bytes_per_param_all=_state_bytes(r["opt"], r["params"]) / numel,
                warmup_s=r["warmup_s"], steps_timed=len(r["times"])))
            print(f"{numel / 1e6:6.2f}M  {name:20s} {med * 1e3:9.2f} ms  "
                  f"{numel / med / 1e6:8.1f} Mparam/s  x{med / ref:5.2f} vs torch fused  "
                  f"x{med / limit:5.2f} of the bytes-moved limit  "
                  f"{rows[-1]['state_bytes_per_param_large']:.3f} B/param (large tensors)",
                  flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=float, nargs="+", default=None,
                    help="params per model (default: 1e6 1e7 on CPU, 1e6 1e7 1e8 on CUDA)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or ([1e6, 1e7, 1e8] if args.device == "cuda" else [1e6, 1e7])
    rows = bench([int(s) for s in sizes], args.steps, args.rounds, args.warmup, args.device)
    import mpfused
    from mpfused.info import source_commit
    meta = dict(device=_device_name(args.device), device_type=args.device,
                threads=torch.get_num_threads(), torch=torch.__version__,
                mpfused=mpfused.__version__, commit=source_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                load_average=os.getloadavg(), steps=args.steps, rounds=args.rounds,
                warmup=args.warmup)
    for mod in ("bitsandbytes", "torchao"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            meta[mod] = None
    os.makedirs(args.out, exist_ok=True)
    tag = "".join(c if c.isalnum() else "-" for c in meta["device"]).strip("-")
    tag = "-".join(filter(None, tag.split("-")))[:40]
    where = f"{meta['threads']}t" if args.device == "cpu" else args.device
    stem = os.path.join(args.out, f"bench_adamw8bit_{tag}_{where}_"
                        f"{datetime.date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {stem}.json and .csv")
    return stem + ".json"


if __name__ == "__main__":
    main()
