"""The CPU update kernels split their work by elements (csrc/cpu/parallel.h, make_slices): the
split's properties, checked on random sizes by a small C++ program (tests/cpu/slices_check.cpp),
and every update kernel bit-identical for any thread count, where the cuts fall inside tensors
at different places (an elementwise update or a whole 8-bit block cannot depend on them)."""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import mpfused
from mpfused import _extension

ROOT = Path(__file__).resolve().parents[1]
CXX = shlex.split(os.environ.get("CXX", "g++"))
HAVE_CXX = bool(CXX) and shutil.which(CXX[0]) is not None


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_make_slices_properties(tmp_path):
    exe = tmp_path / "slices_check"  # (serial: the OpenMP pragmas are ignored without -fopenmp)
    subprocess.run([*CXX, "-O1", "-std=c++17", "-Wno-unknown-pragmas", f"-I{ROOT / 'csrc' / 'cpu'}",
                    str(ROOT / "tests" / "cpu" / "slices_check.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    seed = int.from_bytes(os.urandom(3), "little")
    out = subprocess.run([str(exe), str(seed)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


# sizes: several chunks (cut at different places per thread count), a medium weight, biases,
# a 1-element tensor, one just over a 4096-element 8-bit block
SIZES = [200_001, 65_536, 3001, 128, 1, 4097]
SMALL = [20_000, 3]  # two slices however many threads: a team larger than the slice count
CASES = [
    ("AdamW", dict(master_weights="fp32")),
    ("AdamW", dict(master_weights="remainder", amsgrad=True)),
    ("AdamW", dict(master_weights="none")),  # bf16 stochastic rounding
    ("AdamW8bit", dict(master_weights="remainder", block_size=256, min_8bit_size=4096)),
    ("AdamW8bit", dict(master_weights="remainder8", block_size=64, min_8bit_size=64)),
    ("AdamW4bit", dict(master_weights="fp32")),
    ("SGD", dict(momentum=0.9, master_weights="remainder")),
    ("Lion", dict(master_weights="fp32")),
    ("SGD8bit", dict(momentum=0.9, master_weights="remainder", block_size=256)),
    ("Lion8bit", dict(master_weights="none", block_size=2048)),
]


def _run(name, kwargs, threads, sizes=SIZES, dtype=torch.bfloat16):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
    opt = getattr(mpfused, name)(params, lr=1e-2, weight_decay=1e-2, **kwargs)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape).to(dtype)
            opt.step()
    finally:
        torch.set_num_threads(n)
    out = [p.detach().clone() for p in params]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.skipif(_extension.load() is None, reason="native extension not built")
@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{k['master_weights']}" for n, k in CASES])
def test_update_kernels_bit_identical_for_any_thread_count(name, kwargs):
    _assert_same_for_any_thread_count(name, kwargs)


@pytest.mark.skipif(_extension.load() is None, reason="native extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_slices_than_threads_and_fp32_params(dtype):
    _assert_same_for_any_thread_count("AdamW", dict(master_weights="fp32"), SMALL, dtype)
    _assert_same_for_any_thread_count("AdamW8bit", dict(block_size=64, min_8bit_size=64),
                                      SMALL, dtype)


def _assert_same_for_any_thread_count(name, kwargs, sizes=SIZES, dtype=torch.bfloat16):
    first = _run(name, kwargs, 1, sizes, dtype)
    for threads in (2, 3, 5, 8):
        got = _run(name, kwargs, threads, sizes, dtype)
        assert len(got) == len(first)
        for a, b in zip(first, got):
            assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                       b.view(-1).view(torch.uint8)), threads
