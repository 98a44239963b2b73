"""The 2-process harness of the distributed tests: WORLD gloo workers on CPU, started as
``python -m <worker module> <launch> <rank> <world> <out_dir>``, rendezvous through a FileStore (so
no port race); each runs its jobs and saves its results with ``torch.save`` for the launcher. Every
launch is bounded (``TIMEOUT_S``); a machine where gloo or spawning processes does not work skips
the tests.

Worker modules: tests/distributed_runs.py (AdamW/8-bit under DDP and FSDP2),
distributed_sgd_lion_runs.py, distributed_4bit_runs.py, distributed_release_fsdp_runs.py; their
model, data and snapshots are tests/distributed_model.py's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT_S = 120          # per launch of 2 processes
UNAVAILABLE = "MPFUSED-DIST-UNAVAILABLE"


def join_group(rank, world, out_dir):
    """This worker's gloo process group (a FileStore in out_dir); exit 3 where gloo cannot start
    (the launcher then skips). One intra-op thread: bit-identical forward/backward to the
    single-process reference."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    except Exception as e:  # noqa: BLE001
        print(f"{UNAVAILABLE}: {type(e).__name__}: {e}", flush=True)
        sys.exit(3)


def run_jobs(jobs, rank, out_dir):
    """Every job in turn (one failing scenario fails its own tests only), a barrier after each;
    this rank's results saved for the launcher, then the group left."""
    import torch.distributed as dist

    results = {}
    try:
        for key, fn in jobs.items():
            try:  # one failing scenario fails its own tests only
                results[key] = fn()
            except Exception:  # noqa: BLE001
                results[key] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _launch(launch: str, out_dir: str, module: str):
    """Run `module`'s worker main in WORLD processes; every rank's saved results."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", module, launch, "{rank}", str(WORLD), out_dir]
    try:
        procs = [subprocess.Popen([c.format(rank=r) for c in cmd], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORLD)]
    except OSError as e:
        pytest.skip(f"cannot spawn worker processes: {e}")
    deadline = time.monotonic() + TIMEOUT_S
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail(f"{launch}: workers did not finish in {TIMEOUT_S} s (hang in a collective?)\n"
                    + "\n".join(logs[-2:])[-6000:])
    if any(UNAVAILABLE in log for log in logs):
        pytest.skip("gloo process group unavailable here: "
                    + next(log for log in logs if UNAVAILABLE in log).strip()[-300:])
    for r, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            pytest.fail(f"{launch}: rank {r} exited with {p.returncode}:\n{log[-6000:]}")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]
