"""Timing and reporting shared by the micro-benchmarks: warm-up, medians, device events (CUDA) or
synchronized perf_counter (CPU), measured copy bandwidth, and result files that say which machine,
torch and commit produced them."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mpfused.info import source_commit

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn, device: str, warmup: int = 3, reps: int = 15) -> float:
    """Median seconds of fn() over reps runs after warmup runs."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_train_step(setup, inputs, targets, clock=time.perf_counter,
                     dtype=torch.bfloat16) -> tuple:
    """One training step of a recipe's TrainSetup as the main job runs it (autocast forward,
    scaled backward, scaler.step + update, zero_grad): the clock at its start, after the forward,
    after the backward and at its end."""
    t0 = clock()
    with torch.autocast(inputs.device.type, dtype=dtype):
        loss = setup.model(inputs, targets)
    t1 = clock()
    setup.scaler.scale(loss).backward()
    t2 = clock()
    setup.scaler.step(setup.optimizer)
    setup.scaler.update()
    setup.optimizer.zero_grad(set_to_none=True)
    return t0, t1, t2, clock()


def round_order(names: list, r: int) -> list:
    """The order of round r of a round-robin: rotated every round and reversed every other cycle
    of rotations (rotation alone keeps the cyclic order, so each contender would mostly run right
    after the same one: after a cache-thrashing step, say, in 2 of 3 rounds with 3 contenders)."""
    k = r % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (r // len(names)) % 2 else order


def round_robin(fns: dict, rounds: int, warmup: int) -> dict:
    """What each of fns returns, called in turns after ``warmup`` rounds: per round each fn once,
    in the order of round_order (so drift of the machine hits every contender alike)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out = {n: [] for n in names}
    for r in range(rounds):
        for n in round_order(names, r):
            out[n].append(fns[n]())
    return out


def side_by_side(fns: dict, device: str, warmup: int = 3, reps: int = 21) -> dict:
    """Median seconds of each fn, timed round-robin (a, b, c, a, b, c, ...) so that drift in the
    machine (other tenants, frequency, what the shared cache holds) hits every contender alike.
    The order inside a round changes every round (round_order)."""
    def timed(fn):
        return lambda: median_time(fn, device, warmup=0, reps=1)
    times = round_robin({n: timed(fn) for n, fn in fns.items()}, reps, warmup)
    return {n: statistics.median(t) for n, t in times.items()}


def copy_bandwidth(device: str, nbytes: int = 1 << 28) -> float:
    """Measured bytes/s of a device-to-device copy of `nbytes` (bytes read + bytes written)."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device, warmup=2, reps=7)
    return 2 * src.numel() * 4 / t


_BANDWIDTH_AT: dict = {}


def stream_bandwidth_at(device: str, moved_bytes: int) -> float:
    """The yardstick for a step that moves `moved_bytes`: the better of two measured streams with
    the same working set, so both live in the same level of the memory hierarchy (this 2-core
    CPU's 300 MiB L3 holds a 10M-param AdamW step; an H100's 50 MB L2 holds small steps):
    * a copy (src and dst of moved_bytes / 2): the usual GPU yardstick;
    * an in-place add (a += b, a and b of moved_bytes / 3): what an optimizer does. On a CPU a
      copy's destination is read for ownership before it is written, so a copy reaches about
      half the bytes/s of an in-place update (22 vs 36 GB/s here) and is no roofline for one.
    At least 1 MiB per buffer; cached per (device, size)."""
    key = (str(device), int(moved_bytes) >> 20)
    if key not in _BANDWIDTH_AT:
        copy = copy_bandwidth(device, max(int(moved_bytes) // 2, 1 << 20))
        n = max(int(moved_bytes) // 3 // 4, 1 << 18)
        a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
        b = torch.empty_like(a).uniform_()
        inplace = 3 * n * 4 / median_time(lambda: a.add_(b), device, warmup=2, reps=7)
        _BANDWIDTH_AT[key] = max(copy, inplace)
    return _BANDWIDTH_AT[key]


def machine() -> dict:
    commit = source_commit()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu,
        "cpu_threads": torch.get_num_threads(),
    }


def device_tag(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name().replace(" ", "-").replace("/", "-")
    return f"cpu{os.cpu_count()}"


def write_results(name: str, device: str, rows: list[dict], extra: dict | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{device_tag(device)}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": machine(), **(extra or {}), "rows": rows}, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def split_sizes(total: int, count: int) -> list[int]:
    """count tensor sizes summing to total, deliberately uneven (odd sizes, as real models)."""
    base = total // count
    sizes = [base + (i % 7) - 3 for i in range(count)]
    sizes[-1] += total - sum(sizes)
    return [max(s, 1) for s in sizes]
