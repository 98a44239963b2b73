"""Small tensors of a step move between devices asynchronously, except into host memory, where
the CPU kernels read them at once (a non_blocking GPU -> CPU copy would still be in flight)."""
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
