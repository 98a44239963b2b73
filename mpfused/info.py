"""``python -m mpfused.info``: versions, the native build, and which backend serves each op on
each device (honestly: what torch.ops.mpfused.<op> runs, as routed at import)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

import mpfused
from mpfused import _extension
from mpfused.ops import OPS, router


def source_commit() -> str:
    """Short git commit of the source tree mpfused runs from: ``MPFUSED_COMMIT`` when set (a copy
    of the tree without ``.git``, as on a lent GPU machine), else git, else "unknown"; recorded
    with every benchmark result."""
    env = os.environ.get("MPFUSED_COMMIT", "").strip()
    if env:
        return env[:7]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def report() -> str:
    lines = [
        f"mpfused {mpfused.__version__}",
        f"python {platform.python_version()}  torch {torch.__version__}  "
        f"torch CUDA {torch.version.cuda or 'none'}",
    ]
    try:
        import triton

        lines.append(f"triton {triton.__version__}"
                     + ("  (TRITON_INTERPRET=1: kernels run on CPU)"
                        if os.environ.get("TRITON_INTERPRET") == "1" else ""))
    except ImportError:
        lines.append("triton not installed")
    ext = _extension.load()
    info = _extension.build_info()
    if ext is None:
        lines.append(f"native extension: not loaded ({_extension.error()})")
    else:
        archs = getattr(ext, "cuda_archs", "") or "none"
        lines.append(f"native extension: loaded, built for torch {info.get('torch_version', '?')}, "
                     f"CUDA kernels {'yes' if _extension.with_cuda() else 'no'} (archs: {archs})")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if torch.cuda.is_available():
        lines.append(f"GPU: {torch.cuda.get_device_name()}")
    lines.append(f"MPFUSED_BACKEND at import: {router.REQUEST}")
    lines.append("")
    width = max(len(n) for n in OPS)
    lines.append(f"{'op':<{width}}  " + "  ".join(f"{d:<28}" for d in devices))
    for name, op in sorted(OPS.items()):
        cells = []
        for d in devices:
            chosen = op.route(d)
            cells.append(f"{chosen:<10} (has {','.join(op.available(d))})".ljust(28))
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
