"""Test setup. TRITON_INTERPRET must be set before anything imports triton kernels (the interpreter
is chosen when @triton.jit decorates), so Triton kernels run on CPU tensors here.

OMP_WAIT_POLICY=PASSIVE must be set before torch loads its OpenMP runtime (which reads it once):
an OpenMP thread with no work then sleeps instead of spinning. Same threads, same split of the
work, same results; what changes is the CPU burnt while the suite's small-tensor steps wait at
each parallel region for the other thread, and that the background builds cannot use. Measured
on the loaded 2-core VM, 10 steps of two bench recipes with 2 threads: 6.5 s CPU / 13.3 s wall
spinning, 0.4 s / 0.6 s passive (1 thread: 0.4 s / 0.7 s). Child processes (the ISA builds, the
2-process workers, the GPU plan's dry run) inherit it; the CUDA emulation's sanitizer programs do
not (test_cuda_emulation.program_env says why)."""
import os

if not os.environ.get("MPFUSED_TEST_TRITON_COMPILED"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import mpfused  # noqa: E402,F401
from mpfused.ops import OPS  # noqa: E402

CUDA = torch.cuda.is_available()

# CI's switch (.ci/run sets it): checks that CI sells as guarantees (the CUDA host emulation's
# byte-exact runs, nvcc's compile checks, the ahead-of-time Triton compile with its PTX checks)
# must not turn into skips there. Strict, a missing toolchain or a deadline cut fails the test,
# and the deadlines (there to keep a loaded developer machine's run short) are twice as long.
STRICT = os.environ.get("MPFUSED_STRICT_TESTS") == "1"


def deadline_s(seconds: float) -> float:
    return 2 * seconds if STRICT else seconds


def skip_or_fail(reason: str):
    """pytest.skip, or pytest.fail under MPFUSED_STRICT_TESTS=1."""
    if STRICT:
        pytest.fail(f"MPFUSED_STRICT_TESTS=1: {reason}")
    pytest.skip(reason)
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def backends_for(op_name: str, device: str) -> list[str]:
    """Every backend of an op that can run on `device` here."""
    return OPS[op_name].available(device)


def pytest_generate_tests(metafunc):
    # Tests taking (device, backend) run for every available backend of the op they name in
    # `OP_UNDER_TEST` (module-level constant).
    if {"device", "backend"} <= set(metafunc.fixturenames):
        op = getattr(metafunc.module, "OP_UNDER_TEST")
        params = [(d, b) for d in DEVICES for b in backends_for(op, d)]
        metafunc.parametrize("device,backend", params, ids=[f"{d}-{b}" for d, b in params])


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: loops of small-tensor steps gain nothing from a second
    OpenMP thread, and on a loaded 2-core machine each parallel region waits for it to be
    scheduled (measured: a 300-step storm of test_hardening, 22-32 s wall / 4-5 s CPU with 2
    threads, 1.2 s / 0.2 s with 1). Kernels at every thread count: the tests that set them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs each run, but reproducible from the printed seed on failure.
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def pytest_collection_modifyitems(session, config, items):
    # The modules whose results come from background builds (BACKGROUND_BUILD) run after all the
    # others, in their own order: their builds (~700 s of CPU, most of it the CUDA emulation's
    # sanitizer builds) then have the whole run to use the CPU the other tests leave idle, instead
    # of a third of it, and the suite no longer stops at those modules to wait for them.
    def waits_for_a_build(item):
        return getattr(getattr(item, "module", None), "BACKGROUND_BUILD", None) is not None
    items[:] = sorted(items, key=waits_for_a_build)  # stable: the order within each part stays


def pytest_collection_finish(session):
    _start_background_builds(session)
    # torch.testing._internal.common_utils (imported by the tests that read torch's optim_db)
    # freezes torch.backends' flags on import (disable_global_flags, for torch's own suite);
    # mpfused.amp.setup(tf32=True) sets them as a user's process may, so unfreeze them.
    import torch.backends as backends
    if backends.flags_frozen():  # the flag lives in the functions' module dict (torch wraps it)
        backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


def _start_background_builds(session):
    # The build-and-run jobs of the modules that have them (BACKGROUND_BUILD: the CUDA emulation's
    # and nvcc's builds, the Triton AOT compile) start now, in test order, at the lowest CPU
    # priority, so they use the CPU time the other tests leave idle (tests/background_builds.py).
    from tests import background_builds
    if session.config.option.collectonly:
        return
    seen = set()
    for order, item in enumerate(session.items):
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        fn = getattr(module, "BACKGROUND_BUILD", None)
        if fn is not None:
            tmp = session.config._tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
            background_builds.start(module.__name__, fn, order, tmp)


def pytest_sessionfinish(session):
    from tests import background_builds
    background_builds.close()
