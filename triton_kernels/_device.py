"""The CUDA device of a Triton launch. Triton launches on the *current* device and its current
stream, whatever device the argument tensors live on: a launcher must make the tensors' device
current, as the native bindings do with a CUDAGuard (else, with params on cuda:1 and cuda:0
current, the kernel runs in cuda:0's context on cuda:0's stream against cuda:1's memory)."""
from __future__ import annotations

import functools

import torch


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    return t
    return None


def on_tensors_device(launcher):
    """Run `launcher` with the CUDA device of its first tensor argument current."""
    @functools.wraps(launcher)
    def run(*args, **kwargs):
        t = _first_tensor(args)
        if t is None or t.device.type != "cuda":
            return launcher(*args, **kwargs)
        with torch.cuda.device(t.device):
            return launcher(*args, **kwargs)
    return run
