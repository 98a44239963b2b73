"""torch's own optimizer test database (``torch.testing._internal.common_optimizers.optim_db``):
every configuration torch tests Adam, AdamW and SGD with, run through mpfused.Adam / AdamW / SGD on fp32
params and compared with torch's fp32 for-loop on the same grads (issue 20: "the project's own
suite should exercise torch's optimizer database configs"). The CUDA list is the superset
(capturable, tensor lr, tensor betas); it runs here on CPU, where torch's reference takes the
same config without ``capturable`` (a CUDA-graph flag that changes no arithmetic).
torch's error inputs for the same optimizers: tests/test_dropin_fidelity_api.py."""
import pytest
import torch

import mpfused
from mpfused.ops import OPS
from tests.tolerances import TRAJ_TOL

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")

PAIRS = {"Adam": (mpfused.Adam, torch.optim.Adam), "AdamW": (mpfused.AdamW, torch.optim.AdamW),
         "SGD": (mpfused.SGD, torch.optim.SGD)}
# torch's state keys per optimizer (mpfused.SGD adds a step counter torch's SGD does not keep)
TORCH_KEYS = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
              "SGD": ("momentum_buffer",)}


def _configs():
    out = []
    for info in common_optimizers.optim_db:
        name = info.optim_cls.__name__
        if name not in PAIRS:
            continue
        for oi in info.optim_inputs_func(device="cuda", dtype=torch.float32):
            out.append(pytest.param(name, oi.kwargs, id=f"{name}-{oi.desc}"))
    return out


CONFIGS = _configs()


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def test_the_database_was_read():
    assert len(CONFIGS) >= 19  # Adam and AdamW: 5 CPU configs each, plus the CUDA ones; SGD 9


@pytest.mark.parametrize("name,kwargs", CONFIGS)
def test_torch_config_trajectory(name, kwargs):
    ours_cls, torch_cls = PAIRS[name]
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in ((13, 7), (31,), (2, 3, 5))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    ref_kwargs = {k: _clone(v) for k, v in kwargs.items() if k != "capturable"}
    o_ref = torch_cls(ref, foreach=False, **ref_kwargs)
    o_ours = ours_cls(ours, **{k: _clone(v) for k, v in kwargs.items()})
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        for a, b in zip(ref, ours):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        o_ref.step()
        o_ours.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **TRAJ_TOL)
        keys = TORCH_KEYS[name] + (("max_exp_avg_sq",) if kwargs.get("amsgrad") else ())
        assert set(o_ref.state[a]) - {"step"} == set(keys) & set(o_ours.state[b])
        for key in set(keys) & set(o_ref.state[a]):
            torch.testing.assert_close(o_ours.state[b][key], o_ref.state[a][key], **TRAJ_TOL)
        if "step" in o_ref.state[a]:
            assert o_ours.state[b]["step"].item() == o_ref.state[a]["step"].item()
    # the state_dict loads into torch's optimizer and back (same keys, same layout)
    sd = o_ours.state_dict()
    twin = torch_cls([torch.nn.Parameter(p.detach().clone()) for p in ours], foreach=False,
                     **ref_kwargs)
    twin.load_state_dict(sd)
    assert set(twin.state_dict()["state"][0]) - {"step"} == set(o_ref.state_dict()["state"][0]) - {"step"}
    # and torch's state_dict loads into ours: the next steps agree
    back = ours_cls([torch.nn.Parameter(p.detach().clone()) for p in ref],
                    **{k: _clone(v) for k, v in kwargs.items()})
    back.load_state_dict(o_ref.state_dict())
    for a, b in zip(ref, back.param_groups[0]["params"]):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    o_ref.step()
    back.step()
    for a, b in zip(ref, back.param_groups[0]["params"]):
        torch.testing.assert_close(b, a, **TRAJ_TOL)


SGD_CONFIGS = [c for c in CONFIGS if c.values[0] == "SGD"]
SGD_BACKENDS = [b for b in OPS["sgd_step_"].available("cpu") if b != "native"]


@pytest.mark.parametrize("backend", SGD_BACKENDS)
def test_torch_sgd_configs_on_every_backend(backend):
    """torch's SGD grid (issue 22: "every backend") on the other backends of sgd_step_ (the test
    above runs the default, native one): the same trajectories and momentum buffers."""
    assert len(SGD_CONFIGS) >= 9
    for config in SGD_CONFIGS:
        kwargs = config.values[1]
        torch.manual_seed(0)
        ref = [torch.nn.Parameter(torch.randn(s)) for s in ((13, 7), (31,), (2, 3, 5))]
        ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
        o_ref = torch.optim.SGD(ref, foreach=False, **{k: _clone(v) for k, v in kwargs.items()
                                                       if k != "capturable"})
        o_ours = mpfused.SGD(ours, backend=backend, **{k: _clone(v) for k, v in kwargs.items()})
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            for a, b in zip(ref, ours):
                a.grad = torch.randn(a.shape, generator=gen)
                b.grad = a.grad.clone()
            o_ref.step()
            o_ours.step()
        for a, b in zip(ref, ours):
            torch.testing.assert_close(b, a, **TRAJ_TOL, msg=lambda m: f"{config.id}: {m}")
            if "momentum_buffer" in o_ref.state[a]:
                torch.testing.assert_close(o_ours.state[b]["momentum_buffer"],
                                           o_ref.state[a]["momentum_buffer"], **TRAJ_TOL)
