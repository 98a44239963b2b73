"""The suite's build-and-run jobs (the CUDA host emulation's g++ builds, nvcc's compile checks, the
Triton AOT compile), started when the tests are collected and run in the background while the
other tests run, each module's results picked up by its fixture.

Why: those jobs are ~2/3 of the suite's CPU time, and most of the other tests keep one of two cores
busy. Started at collection, at the lowest CPU priority (nice 19, so they take only CPU time the
tests leave idle), they are mostly done when their module is reached; run only when their module is
reached (as before), both cores worked on them while every other test waited. Their modules run
after all the others (conftest.pytest_collection_modifyitems), so the builds have the whole run.

How (tests/conftest.py wires it):
* A module opts in with a module-level `BACKGROUND_BUILD = fn` (fn(job) -> results, where `job`
  is that module's `Job`); at collection, every collected module's fn starts in its own thread.
* Its subprocesses go through `job.run(cmd)`: at most SLOTS of them run at once, all modules
  together; a module that is waited for gets the next free slot first, then modules in test order,
  and background jobs do not count against a waited-for module's SLOTS.
* `result(module, deadline_s)` (the module fixture) waits for fn's result. The module's deadline
  (the time its jobs may still take, conftest.deadline_s) starts when its fixture starts waiting,
  as it did when the fixture did the work itself: a job still running then is cut (rc None) when
  the deadline passes, one not yet started is not run. Background time is never charged to it.
* `once(key, job, fn)`: a job shared by modules (an object file two programs link) runs once.
* The session's end (conftest) kills what still runs.
A module run alone (`pytest tests/test_X.py`) starts its jobs at collection too; a module whose
BACKGROUND_BUILD was not started (not collected by this conftest) runs them when first asked.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable

NICE = 19
SLOTS = max(2, os.cpu_count() or 2)
_POLL_S = 0.25


class Job:
    """One module's background work: its subprocesses, its deadline, its priority."""

    def __init__(self, name: str, order: int, tmp_dir):
        self.name, self.order, self.tmp = name, order, tmp_dir
        self.deadline: float | None = None  # set when the module's fixture starts waiting
        self.deadline_s: float | None = None
        self.future: Future = Future()
        self.boosted = False  # a waited-for module waits on a job this module shares (once)

    @property
    def waited(self) -> bool:
        """Its module's fixture waits for it (or for a job it shares): normal priority."""
        return self.deadline is not None or self.boosted

    def run(self, cmd: list[str], env: dict | None = None) -> tuple[int | None, str]:
        """(returncode, "$ cmd\\nstdout+stderr"); returncode None: cut by the module deadline (or
        not run: the deadline passed, or the session ended, before it could start)."""
        with _slot(self):
            while True:
                if self.deadline is not None and time.monotonic() >= self.deadline - 1:
                    return None, "not run: module deadline reached (machine too busy?)"
                if _closed.is_set():
                    return None, "not run: the test session ended"
                niced = not self.waited
                try:
                    p = subprocess.Popen([*_NICE_CMD, *cmd] if niced else cmd, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                except OSError as e:
                    return 127, f"$ {' '.join(cmd)}\n{type(e).__name__}: {e}"
                with _lock:
                    _procs.add(p)
                try:
                    while True:
                        try:
                            out, err = p.communicate(timeout=_POLL_S)
                            return p.returncode, f"$ {' '.join(cmd)}\n{out}{err}"
                        except subprocess.TimeoutExpired:
                            pass
                        late = self.deadline is not None and time.monotonic() >= self.deadline
                        if late or _closed.is_set():
                            p.kill()
                            p.communicate()
                            why = (f"cut by the module deadline ({self.deadline_s:.0f} s)" if late
                                   else "cut: the test session ended")
                            return None, f"{why}: {' '.join(cmd)}"
                        if niced and self.waited:
                            # Its module is waited for now: the job gets the normal priority
                            # back (on a loaded machine nice 19 would starve it). Where the
                            # priority cannot be raised again (no CAP_SYS_NICE), start it anew.
                            niced = False
                            if not _renice_tree(p.pid, _BASE_NICE):
                                p.kill()
                                p.communicate()
                                break
                finally:
                    with _lock:
                        _procs.discard(p)


_BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0)


# `nice` execs the command (same pid): everything it starts inherits the priority. (Not
# preexec_fn: not safe with the threads this module runs.)
_NICE_CMD = ["nice", "-n", str(NICE)] if shutil.which("nice") else []


def _renice_tree(pid: int, nice: int) -> bool:
    """Sets the niceness of pid and its descendants (a compiler driver's cc1plus, ptxas, ...);
    False where that is not permitted."""
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            os.setpriority(os.PRIO_PROCESS, p, nice)
        except ProcessLookupError:
            continue
        except PermissionError:
            return False
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return True


# ---- slots: at most SLOTS subprocesses at once; waited-for modules first, then test order -----
_lock = threading.Lock()
_cond = threading.Condition(_lock)
_running = {True: 0, False: 0}  # subprocesses running, by whether their module was waited for
_queue: list[tuple[Job, int]] = []  # (job, ticket) asking for a slot
_tickets = itertools.count()
_procs: set = set()
_closed = threading.Event()
_jobs: dict[str, Job] = {}
_once: dict = {}


class _slot:
    """At most SLOTS subprocesses of waited-for modules, and at most SLOTS in all counting the
    background ones (which do not hold a waited-for module back: at nice 19 they yield the CPU)."""

    def __init__(self, job: Job):
        self.job = job
        self.waited = False

    def _free(self) -> bool:
        if self.job.waited:
            return _running[True] < SLOTS
        return sum(_running.values()) < SLOTS and not any(j.waited for j, _ in _queue)

    def __enter__(self):
        with _cond:
            me = (self.job, next(_tickets))
            _queue.append(me)
            while not (self._free() and min(_queue, key=_rank) is me):
                _cond.wait(_POLL_S)  # a job's priority changes when its module starts waiting
            _queue.remove(me)
            self.waited = self.job.waited
            _running[self.waited] += 1
            _cond.notify_all()  # the next in line may take another free slot

    def __exit__(self, *exc):
        with _cond:
            _running[self.waited] -= 1
            _cond.notify_all()


def _rank(entry):
    job, ticket = entry
    return (not job.waited, job.order, ticket)


# ---- modules --------------------------------------------------------------------------------
def start(name: str, fn: Callable[[Job], object], order: int, tmp_dir) -> Job:
    """Starts module `name`'s fn(job) in a thread (once)."""
    with _lock:
        if name in _jobs:
            return _jobs[name]
        job = _jobs[name] = Job(name, order, tmp_dir)

    def work():
        try:
            job.future.set_result(fn(job))
        except BaseException as e:  # noqa: BLE001  (re-raised in the module's fixture)
            job.future.set_exception(e)

    threading.Thread(target=work, name=f"background build {name}", daemon=True).start()
    return job


def result(name: str, fn: Callable[[Job], object], deadline_s: float, tmp_factory):
    """fn's result for module `name` (starting it now if it was not started at collection); the
    module's deadline of deadline_s seconds starts now."""
    job = _jobs.get(name) or start(name, fn, -1, tmp_factory.mktemp(name.rsplit(".", 1)[-1]))
    with _cond:
        job.deadline_s = deadline_s
        job.deadline = time.monotonic() + deadline_s
        _cond.notify_all()
    return job.future.result()


def once(key, job: Job, fn: Callable[[], object]):
    """fn() once per key for the whole session, run by the first caller's `job`; other callers
    wait for its result (where one's module is waited for, the running job gets its priority)."""
    with _lock:
        entry = _once.get(key)
        mine = entry is None
        if mine:
            entry = _once[key] = (Future(), job)
    fut, owner = entry
    if mine:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
    while not fut.done():
        if job.waited and not owner.waited:
            with _cond:
                owner.boosted = True
                _cond.notify_all()
        try:
            return fut.result(timeout=_POLL_S)
        except FutureTimeout:
            pass
    return fut.result()


def close():
    """The session is over: kill every job's subprocess, run no more."""
    _closed.set()
    with _lock:
        procs = list(_procs)
    for p in procs:
        try:
            p.kill()
        except OSError:
            pass
