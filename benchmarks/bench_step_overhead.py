"""What ``opt.step()`` costs from Python beyond its op, on the CPU: side by side in one process,
per optimizer (Lion / SGD / AdamW, 8- and 4-bit, one 1M-element bf16 param with ``remainder8`` /
``remainder`` / ``fp32`` masters, or an fp32 param):

* ``torch_entry``: the step as torch's wrapper runs it (``Optimizer.profile_hook_step``'s
  record_function and hooks, ``torch.no_grad()``, torch's graph-capture health check each step):
  the path ``mpfused/optim/_step_entry.py`` keeps while a profiler runs;
* ``step``: ``opt.step()`` as it is now (the lean entry when no profiler runs);
* ``op``: the bucket's bound native call alone (``BoundLists.<op>`` with the step's arguments):
  the floor, binding included.

Each timed call follows a 64 MB pass over memory (``--no-flush``: no pass), as a step does in
training (the forward and backward evict the step's code and data) and as in the other benchmarks'
round-robins, where a step follows another optimizer's: the Python around the op then costs
several times its warm ~25 us. Thread CPU time (the machine is shared), rounds in
benchmarks.common.round_order, medians. Not a test:
    OMP_NUM_THREADS=1 python -m benchmarks.bench_step_overhead [--numel 1e6] [--reps 41]
        [--masters remainder8 remainder fp32 fp32param] [--no-flush]
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
from benchmarks.common import round_order  # noqa: E402
import mpfused  # noqa: E402
from mpfused.ops.bound import BoundOp  # noqa: E402
from mpfused.optim import _step_entry  # noqa: E402

OPTIMIZERS = (("Lion4bit", {}), ("Lion8bit", {}), ("SGD4bit", {"momentum": 0.9}),
              ("SGD8bit", {"momentum": 0.9}), ("AdamW4bit", {}), ("AdamW8bit", {}))


def _make(n, name, kw, master, g):
    p0, grad = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
    dt = torch.float32 if master == "fp32param" else torch.bfloat16
    p = torch.nn.Parameter(p0.to(dt))
    p.grad = grad.to(dt)
    kw = dict(kw) if master == "fp32param" else dict(kw, master_weights=master)
    return getattr(mpfused, name)([p], lr=1e-3, min_8bit_size=0, **kw)


def _bound_call(opt):
    """The op call of opt's step, with the step's arguments, on the native lists."""
    seen = {}
    orig = BoundOp.__call__

    def spy(self, *a, **k):
        seen["call"] = (self, a, k)
        return orig(self, *a, **k)
    BoundOp.__call__ = spy
    try:
        opt.step()
    finally:
        BoundOp.__call__ = orig
    b, a, k = seen["call"]
    ordered = [k.get(name, d) for name, d in b._keywords]
    return lambda: b._step(a[0], *a[1:], *ordered)


def _torch_entry(opt):
    """opt.step() through torch's wrapper and health check (step_entry's profiler path)."""
    def run():
        enabled, _step_entry._profiler_enabled = _step_entry._profiler_enabled, lambda: True
        saved = list(_step_entry._NO_GRAPH_CAPTURE)
        _step_entry._NO_GRAPH_CAPTURE[:] = [False]
        try:
            opt.step()
        finally:
            _step_entry._profiler_enabled = enabled
            _step_entry._NO_GRAPH_CAPTURE[:] = saved
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=float, default=1e6)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--masters", nargs="+", default=["remainder8", "remainder", "fp32"])
    ap.add_argument("--no-flush", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    fns = {}
    for name, kw in OPTIMIZERS:
        for master in args.masters:
            opt = _make(int(args.numel), name, kw, master, g)
            case = f"{name}+{master}"
            fns[(case, "torch_entry")] = _torch_entry(opt)
            fns[(case, "step")] = opt.step
            fns[(case, "op")] = _bound_call(opt)
    flush = None if args.no_flush else torch.zeros(16 << 20)
    for f in fns.values():
        f()
        f()
    times = {k: [] for k in fns}
    for r in range(args.reps):
        for k in round_order(list(fns), r):
            if flush is not None:
                flush.add_(1.0)
            t = time.thread_time()
            fns[k]()
            times[k].append(time.thread_time() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"numel {int(args.numel)}, {torch.get_num_threads()} thread(s), flush "
          f"{'no' if flush is None else '64 MB'}: ms of thread CPU time (medians of {args.reps})")
    print(f"{'case':24s} {'torch_entry':>11s} {'step':>7s} {'op':>7s} {'torch/op':>8s} "
          f"{'step/op':>7s}")
    for case in dict.fromkeys(c for c, _ in fns):
        te, st, op = med[(case, "torch_entry")], med[(case, "step")], med[(case, "op")]
        print(f"{case:24s} {te:11.3f} {st:7.3f} {op:7.3f} {te / op:8.3f} {st / op:7.3f}")


if __name__ == "__main__":
    main()
