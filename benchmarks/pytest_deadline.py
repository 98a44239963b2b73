"""Per-test time limit for the GPU run, as a pytest plugin loaded with `-p benchmarks.pytest_deadline`
(no conftest change, no pytest-timeout: CI's machine does not have it, so this one is testable
there). `--deadline=S` gives each test S seconds:

* at S, SIGALRM fails the test by name (pytest.fail) and the run goes on; this works whenever the
  test is running Python or returns from C++ (a CUDA sync that comes back);
* at 2 S the test is stuck in native code: faulthandler prints every thread's stack and exits the
  process, and `-v` has already printed the test's id, so the log names it.

The suite's outer `timeout -s INT` then still gets pytest's summary and junit XML for everything
that finished (SIGINT, unlike SIGTERM, makes pytest stop cleanly)."""
from __future__ import annotations

import faulthandler
import signal
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption("--deadline", type=float, default=0.0,
                     help="seconds per test: fail it at S, dump stacks and exit at 2*S (0: off)")


def _alarm(signum, frame):
    pytest.fail(f"deadline: the test ran past {_alarm.seconds:g} s", pytrace=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("deadline")
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return
    _alarm.seconds = seconds
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(2 * seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
