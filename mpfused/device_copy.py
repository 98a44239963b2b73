"""Moving the small tensors of a step (found_inf, scales, norms, lr) between devices."""
from __future__ import annotations

import torch


def copy_to(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`, asynchronously except into host memory: a non_blocking copy from a GPU to
    the CPU returns before the data lands (the pinned buffer is filled later on the GPU's stream),
    and the CPU kernels or host reads that come next would see stale values."""
    device = torch.device(device)
    to_host = device.type == "cpu" and t.device.type != "cpu"
    if (device.type == "cuda" and t.device.type == "cpu"
            and torch.cuda.is_current_stream_capturing()):
        # Captured, the copy would replay from whatever the host buffer holds then (and recent
        # torch refuses pageable copies during capture with an error that names no tensor).
        raise RuntimeError(
            f"a CPU tensor (shape {tuple(t.shape)}, {t.dtype}) is copied to {device} during "
            "CUDA graph capture; keep tensor hyperparameters of a captured step (a tensor lr, "
            "grad_scale, found_inf) on the GPU")
    return t.to(device, non_blocking=not to_host)
