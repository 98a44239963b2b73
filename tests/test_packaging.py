"""Foundation: import never fails, backend selection, the installed layout, 64-bit indexing."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import mpfused
from mpfused.ops import OPS, amp as amp_ops

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=ROOT, timeout=120)


def test_import_without_extension_warns_and_falls_back():
    r = run_py("import torch, mpfused\n"
               "from mpfused.ops import OPS\n"
               "g=[torch.tensor([4., float('inf')])]; f=torch.zeros(())\n"
               "OPS['unscale_grads_'](g, f, torch.tensor(.5))\n"
               "print(OPS['unscale_grads_'].route('cpu'), f.item(), g[0][0].item())",
               MPFUSED_NO_EXT="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "1.0", "2.0"]


def test_missing_extension_warns_once(monkeypatch):
    from mpfused import _extension as e

    for name, value in (("_tried", False), ("_module", None), ("_error", None)):
        monkeypatch.setattr(e, name, value)
    monkeypatch.setitem(sys.modules, "mpfused._C", None)  # makes `from mpfused import _C` fail
    monkeypatch.delattr(mpfused, "_C", raising=False)
    with pytest.warns(RuntimeWarning, match="native extension unavailable"):
        assert e.load() is None
    assert e.load() is None  # second call: no new warning (pytest.warns not needed)


def test_extension_built_for_another_torch_is_not_loaded(monkeypatch):
    from mpfused import _extension as e

    for name, value in (("_tried", False), ("_module", None), ("_error", None)):
        monkeypatch.setattr(e, name, value)
    monkeypatch.setattr(e, "build_info", lambda: {"torch_version": "1.13.0"})
    with pytest.warns(RuntimeWarning, match="built for torch 1.13.0"):
        assert e.load() is None


def test_backend_selection(monkeypatch):
    """An explicit backend= names an implementation (checked by name), else the dispatcher's."""
    op = OPS["unscale_grads_"]
    assert op.impl("reference", "cpu") is op.reference
    with pytest.raises(ValueError, match="backend must be one of"):
        op([torch.ones(2)], torch.zeros(()), torch.ones(()), backend="cuda-fast")
    with pytest.raises(RuntimeError, match="not available for op unscale_grads_ on cuda"
                       if not torch.cuda.is_available() else "."):
        if torch.cuda.is_available():
            raise RuntimeError(".")
        op.impl("native", "cuda")


@pytest.mark.parametrize("archs,capability,runs", [
    ("8.0;9.0+PTX", (8, 0), True), ("8.0;9.0+PTX", (8, 6), True),  # A100, RTX 30xx (sm_86)
    ("8.0;9.0+PTX", (8, 9), True), ("8.0;9.0+PTX", (9, 0), True),
    ("8.0;9.0+PTX", (10, 0), True), ("8.0;9.0+PTX", (12, 0), True),  # Blackwell: PTX by JIT
    ("8.0;9.0+PTX", (7, 5), False), ("8.0;9.0+PTX", (7, 0), False),  # T4, V100: Triton
    ("8.0;9.0", (10, 0), False), ("8.6", (8, 0), False), ("9.0a", (9, 0), True),
    ("8.0 9.0", (9, 0), True), ("", (9, 0), False), ("Ampere;Hopper", (9, 0), True),
])
def test_native_cuda_kernels_need_code_for_the_gpu(archs, capability, runs):
    from mpfused._extension import archs_run_on
    assert archs_run_on(archs, capability) is runs


def test_auto_prefers_native_on_cpu_when_built():
    from mpfused.ops import router
    if _extension_loaded() and router.REQUEST == "auto":
        assert OPS["unscale_grads_"].route("cpu") == "native"


def _extension_loaded() -> bool:
    from mpfused import _extension
    return _extension.load() is not None


def test_info_reports():
    r = subprocess.run([sys.executable, "-m", "mpfused.info"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in OPS:
        assert name in r.stdout
    assert "native extension:" in r.stdout and "torch" in r.stdout


def test_source_commit_prefers_mpfused_commit(monkeypatch):
    """A tree without .git (a lent GPU machine) names its commit through MPFUSED_COMMIT, which
    every benchmark result records; without it, git's short commit of this checkout."""
    from mpfused.info import source_commit

    monkeypatch.delenv("MPFUSED_COMMIT", raising=False)
    from_git = source_commit()
    monkeypatch.setenv("MPFUSED_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert source_commit() == "0123456"
    assert from_git != "0123456"


def test_triton_kernels_installed_under_mpfused(tmp_path):
    """A wheel holds mpfused/triton_kernels and never a top-level triton_kernels package."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       env={**os.environ, "MPFUSED_NO_EXT": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert "mpfused/triton_kernels/amp.py" in names
    assert not any(n.startswith("triton_kernels/") for n in names)
    import mpfused.triton_kernels  # noqa: F401  (editable install maps it too)


def test_64bit_indexing_check_pass():
    """A tensor over 2^31 elements: the last element's inf is seen, the norm covers it."""
    n = 2**31 + 5
    try:
        g = torch.zeros(n, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("not enough memory for a 2^31-element tensor")
    g[-1] = 3.0
    g[2**31 + 1] = 4.0
    found, norm = torch.zeros(()), torch.zeros(())
    amp_ops.check_grads([g], found, torch.ones(()), norm_sq=norm)
    assert found.item() == 0.0 and norm.item() == 25.0
    g[-2] = float("inf")
    amp_ops.check_grads([g], found, torch.ones(()))
    assert found.item() == 1.0
    del g
