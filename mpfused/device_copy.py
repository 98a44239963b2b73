"""Moving the small tensors of a step (found_inf, scales, norms, lr) between devices."""
from __future__ import annotations

import torch


def copy_to(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`, asynchronously except into host memory: a non_blocking copy from a GPU to
    the CPU returns before the data lands (the pinned buffer is filled later on the GPU's stream),
    and the CPU kernels or host reads that come next would see stale values."""
    device = torch.device(device)
    to_host = device.type == "cpu" and t.device.type != "cpu"
    return t.to(device, non_blocking=not to_host)
