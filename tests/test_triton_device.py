"""Triton launches run on the device of their tensors: Triton itself launches on the *current*
CUDA device, so every launcher makes its first tensor's device current (as the native bindings'
CUDAGuard), and refuses operands on another device."""
import contextlib

import pytest
import torch

from mpfused.triton_kernels import _device
from mpfused.triton_kernels.adam8bit import adam8bit_step_
from mpfused.triton_kernels.amp import check_grads


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (no GPU here)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_launcher_runs_with_the_tensors_device_current(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []
    launcher = _device.on_tensors_device(lambda *a, **k: seen.append(list(entered)))
    fake = torch.Tensor._make_subclass(_OnCuda1, torch.zeros(2))
    launcher([fake], torch.zeros(1), key=1)
    assert seen == [[torch.device("cuda", 1)]]
    launcher([torch.zeros(2)], torch.zeros(1))  # CPU: no device switch
    assert seen[-1] == [torch.device("cuda", 1)] and len(entered) == 1
    launcher(None, 3.0)  # no tensor at all
    assert len(seen) == 3


def test_operands_on_another_device_are_refused():
    found, inv = torch.zeros(()), torch.ones(())
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on meta, found_inf on cpu"):
        check_grads([torch.zeros(3), torch.zeros(3, device="meta")], found, inv)
    n = 256
    args = ([torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n, dtype=torch.uint8)],
            [torch.zeros(n, dtype=torch.uint8, device="meta")], [torch.ones(1)], [torch.ones(1)],
            [], [torch.zeros(())])
    from mpfused.quant_maps import signed_map, unsigned_map
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] is on meta, expected cpu "
                                           r"\(the params' device\)"):
        adam8bit_step_(*args, signed_map(), unsigned_map(), block_size=256, lr=1e-3,
                       lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                       maximize=False, decoupled=True, master_mode=0)
