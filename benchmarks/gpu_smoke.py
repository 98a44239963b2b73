"""Per-kernel smoke test, run before pytest on a GPU: each case (op x backend x dtype x mode; the
cases are benchmarks/smoke_cases.py's) runs once on the device and is compared with the CPU
native kernel (else the reference) on the same inputs. One line per case:

    PASS|FAIL|SKIP  op  backend  dtype  mode  max_err  note

SGD, Lion and their 8-bit and 4-bit forms (EXACT_FAMILIES) must equal the CPU kernel bit for bit:
the same per-element functions run on both. The others pass within a tolerance and say whether
they were exact. Every op has a native CUDA kernel (8-bit SGD / Lion since issue 22, 4-bit SGD /
Lion since issue 24); an op without a
kernel for a backend on the device (e.g. a CUDA extension built from an older commit, or Triton
missing) gives a SKIP line, and the last line counts the verdicts and names those.

Each op family (native and Triton) runs in its own worker process with CUDA_LAUNCH_BLOCKING=1, so
an error is attributed to the launch that made it; --jobs families run at once. A CUDA error
poisons the process's context: the worker stops there and a fresh one resumes the remaining
cases; a hang is killed after --timeout s and the rest resume too. So every kernel gets a verdict
even if one of them crashes.

    python -m benchmarks.gpu_smoke [--device cuda] [--backends native,triton] [--timeout 60] [--jobs 9]
On CPU (`--device cpu --backends native`) the same cases and calls run as the dry run's stand-in.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import subprocess
import sys
import threading
import time
import zlib

from benchmarks.smoke_cases import (DTYPE_MODES, DTYPES, EXACT_FAMILIES, FAMILIES,  # noqa: F401
                                    MODES, cases, inputs as _inputs)


# ---------------------------------------------------------------- worker side (imports torch)

def _to(obj, device):
    import torch
    if isinstance(obj, torch.Tensor):
        # keep the layout: a view (offset or transposed) is rebuilt as a view of a copy of its base
        if obj._base is None:
            return obj.to(device, copy=True)  # a copy on CPU too: the stand-in compares two runs
        return obj._base.to(device, copy=True).as_strided(obj.shape, obj.stride(), obj.storage_offset())
    if isinstance(obj, list):
        return [_to(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _max_err(got, want) -> float:
    """Largest difference relative to the tensor's largest value (codes: the share that differ);
    inf when NaNs are not in the same places."""
    import torch
    got = got.cpu()
    if got.dtype in (torch.uint8, torch.int16, torch.int32):
        return float((got.to(torch.int64) != want.to(torch.int64)).float().mean())
    g, w = got.double(), want.double()
    if not torch.equal(g.isnan(), w.isnan()):
        return float("inf")
    ok = ~w.isnan()
    if not ok.any():
        return 0.0
    return float((g - w)[ok].abs().max() / w[ok].abs().max().clamp_min(1e-30))


def run_case(case: tuple, device: str) -> tuple[bool, float, str]:
    import torch
    from mpfused.ops import OPS

    op, backend, dtype, mode = case
    # a seed fixed per case (hash() of strings changes with every process: a flaky input stream)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) & 0xFFFF)
    args, kwargs, outs = _inputs(op, dtype, mode, gen)
    dargs, dkwargs = _to(args, device), _to(kwargs, device)
    # the same structure on the device: find each output there by identity of position
    flat = lambda a, k: [t for t in _walk(a) + _walk(list(k.values()))]  # noqa: E731
    pos = [next(i for i, t in enumerate(flat(args, kwargs)) if t is o) for o in outs]
    douts = [flat(dargs, dkwargs)[i] for i in pos]
    ref_backend = "native" if "native" in OPS[op].available("cpu") else "reference"
    if device == "cpu" and backend == "native":
        ref_backend = "reference"  # the stand-in: native CPU against the reference
    t0 = time.perf_counter()
    OPS[op](*dargs, **dkwargs, backend=backend)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    OPS[op](*args, **kwargs, backend=ref_backend)
    # bit equality (NaN payloads aside: Triton's fp16 NaN is 0x7FFF, the CPU's 0x7E00)
    exact = all(torch.equal(d.cpu(), o) or (d.is_floating_point() and torch.equal(
        d.cpu().nan_to_num(0.0), o.nan_to_num(0.0))) for d, o in zip(douts, outs))
    if mode.endswith(("remainder", "remainder8")):
        # judge the fp32 value (bf16 param + int16 remainder / int8 correction), not the raw bits
        n = len(args[0])
        douts = _join_remainder(douts, n, mode)
        outs = _join_remainder(outs, n, mode)
    # codes: the share that differ over all code tensors of the case (one flip in a 561-element
    # tensor is 0.18% of it, but the rule is about rare threshold flips, not tensor sizes)
    pairs = [(d, o) for d, o in zip(douts, outs) if not o.is_floating_point()]
    code_err = (sum(_max_err(d, o) * o.numel() for d, o in pairs)
                / max(sum(o.numel() for _, o in pairs), 1))
    err = max((_max_err(d, o) for d, o in zip(douts, outs) if o.is_floating_point()), default=0.0)
    # 16-bit results may differ from the CPU by rounding; 8-bit codes (and step counts) by a rare
    # flip at a threshold; except where the CPU kernel runs the same math: then bit for bit
    tol, code_tol = (1e-5 if dtype == "fp32" else 1e-2), 1e-3
    strict = op in EXACT_FAMILIES and ref_backend == "native"
    how = "exact" if exact else ("NOT bit-equal, " if strict else "") + f"within {tol:g}" + (
        f", codes {code_err:.2g} differ" if code_err else "")
    ok = exact if strict else (err <= tol and code_err <= code_tol)
    return ok, err, f"{how} vs cpu-{ref_backend}{' (bit for bit)' if strict else ''}, {dt * 1e3:.1f} ms"


def _join_remainder(outs: list, n: int, mode: str = "remainder") -> list:
    """outs = params (n) + ... + remainders (n) + steps (n): params and remainders (int16, or
    remainder8's int8 corrections) become fp32."""
    import torch
    from mpfused.reference.adam import remainder8_join
    p, rem = outs[:n], outs[-2 * n:-n]
    if mode.endswith("remainder8"):
        joined = [remainder8_join(x.cpu().contiguous(), r.cpu().contiguous()).float()
                  for x, r in zip(p, rem)]
        return joined + outs[n:-2 * n] + outs[-n:]
    joined = [((x.cpu().contiguous().view(torch.int16).to(torch.int32) << 16)
               | (r.cpu().contiguous().to(torch.int32) & 0xFFFF)).view(torch.float32)
              for x, r in zip(p, rem)]
    return joined + outs[n:-2 * n] + outs[-n:]


def _walk(x):
    import torch
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _walk(v)]
    return []


def worker(idx: list[int], backends: list[str], device: str) -> None:
    import torch

    import mpfused  # noqa: F401
    from mpfused.ops import OPS

    all_cases = cases(backends)
    # MPFUSED_SMOKE_FAULT="i:crash,j:hang": the dry run's check that a crash or a hang costs one
    # case and not the family
    faults = dict(f.split(":") for f in os.environ.get("MPFUSED_SMOKE_FAULT", "").split(",") if f)
    for i in idx:
        case = all_cases[i]
        print(f"START {i}", flush=True)
        if faults.get(str(i)) == "crash":
            os.abort()
        if faults.get(str(i)) == "hang":
            time.sleep(3600)
        op, backend = case[0], case[1]
        if backend not in OPS[op].available(device):
            print(f"RESULT {i} SKIP nan no {backend} kernel registered for {op} on {device}", flush=True)
            continue
        try:
            ok, err, note = run_case(case, device)
            print(f"RESULT {i} {'PASS' if ok else 'FAIL'} {err:.3g} {note}", flush=True)
        except Exception as e:  # noqa: BLE001
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            print(f"RESULT {i} FAIL nan {msg}", flush=True)
            if device == "cuda" and ("CUDA" in msg or "AcceleratorError" in msg):
                sys.exit(3)  # the context may be dead: a fresh process takes the rest
    del torch


# ---------------------------------------------------------------- parent side (no torch)

def _run_group(idx: list[int], args, all_cases, out) -> bool:
    ok = True
    todo = list(idx)
    while todo:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--worker", ",".join(map(str, todo)),
               "--device", args.device, "--backends", args.backends]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        current, deadline, tail = None, time.monotonic() + args.timeout + 60, []  # +60: start-up
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                proc.kill()
                verdict = f"FAIL  nan  killed after {args.timeout} s (hang)"
                break
            if line is None:
                proc.wait()
                verdict = f"FAIL  nan  worker died (rc {proc.returncode}): {' | '.join(tail[-3:])}"
                break
            parts = line.split(maxsplit=4)
            if parts[:1] == ["START"]:
                current, deadline = int(parts[1]), time.monotonic() + args.timeout
            elif parts[:1] == ["RESULT"]:
                i = int(parts[1])
                todo.remove(i)
                _emit(out, parts[2], all_cases[i], parts[3], parts[4].strip() if len(parts) > 4 else "")
                ok &= parts[2] != "FAIL"
                current = None
            elif line.strip() and not line.startswith(("frame #", "<omitting", "Exception raised")):
                tail.append(line.strip())
        if not todo:
            break
        if current is None:  # died between cases (import, start-up): nothing can be attributed
            for i in todo:
                _emit(out, "FAIL", all_cases[i], "nan", "not run: " + verdict.split("  ", 2)[2])
            return False
        todo.remove(current)
        _emit(out, *verdict.split("  ", 2)[:1], all_cases[current], "nan", verdict.split("  ", 2)[2])
        ok = False
    return ok


_LOCK = threading.Lock()  # families run in parallel (--jobs): one line at a time
TALLY: dict = {"PASS": 0, "FAIL": 0, "SKIP": 0, "skipped": set()}


def _emit(out, verdict, case, err, note):
    line = f"{verdict:<4}  {case[0]:<15} {case[1]:<9} {case[2]:<4}  {case[3]:<22} max_err={err:<9} {note}"
    with _LOCK:
        TALLY[verdict if verdict in TALLY else "FAIL"] += 1
        if verdict == "SKIP":
            TALLY["skipped"].add(f"{case[0]} {case[1]}")
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="native,triton")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before a kill")
    ap.add_argument("--jobs", type=int, default=1, help="op families run at once (one process each)")
    ap.add_argument("--out", help="also write the lines to this file")
    ap.add_argument("--only", default="", help="comma-separated op families (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    if args.worker is not None:
        worker([int(i) for i in args.worker.split(",")], backends, args.device)
        return 0
    all_cases = cases(backends)
    out = open(args.out, "w") if args.out else None
    fams = [f for f in FAMILIES if not args.only or f in args.only.split(",")]
    # one process per op family (all its backends: a process start-up with CUDA costs seconds);
    # families in parallel: each has its own CUDA context, so a crash stays in its family
    groups = [[i for i, c in enumerate(all_cases) if c[0] == fam] for fam in fams]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        ok = all(list(pool.map(lambda idx: _run_group(idx, args, all_cases, out), groups)))
    skipped = sorted(TALLY["skipped"])
    tally = (f"smoke: {'all PASS' if ok else 'FAILURES'}: {TALLY['PASS']} PASS, {TALLY['FAIL']} FAIL, "
             f"{TALLY['SKIP']} SKIP" + (f" (no kernel on {args.device}: {', '.join(skipped)})"
                                        if skipped else ""))
    print(tally, flush=True)
    if out:
        out.write(tally + "\n")
        out.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
