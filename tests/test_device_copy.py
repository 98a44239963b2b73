"""Small tensors of a step move between devices asynchronously, except into host memory, where
the CPU kernels read them at once (a non_blocking GPU -> CPU copy would still be in flight)."""
import pytest
import torch

from mpfused.device_copy import copy_to


class _Recorded(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 and records how it is copied (no GPU here)."""
    calls: list = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    def to(self, *args, **kwargs):
        _Recorded.calls.append((args, kwargs))
        return torch.zeros(())


def test_copy_into_host_memory_is_blocking():
    t = torch.Tensor._make_subclass(_Recorded, torch.zeros(()))
    _Recorded.calls.clear()
    copy_to(t, "cpu")
    copy_to(t, torch.device("cuda", 1))
    assert [k["non_blocking"] for _, k in _Recorded.calls] == [False, True]


def test_copy_on_the_host_keeps_the_tensor():
    t = torch.ones(3)
    assert copy_to(t, "cpu") is t


def test_cpu_tensor_into_a_captured_step_is_a_clear_error(monkeypatch):
    """A CPU tensor lr copied to the GPU inside CUDA graph capture would replay from a stale
    host buffer: refused, naming the rule (capture mocked: no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during CUDA graph capture.*on the GPU"):
        copy_to(torch.tensor(1e-3), "cuda")
    assert copy_to(torch.ones(2), "cpu").device.type == "cpu"  # host to host: no copy at all
