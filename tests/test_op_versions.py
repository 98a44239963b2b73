"""Version counters (csrc/bindings/op_versions.cpp): every mutating op bumps the version of each
tensor it writes, as torch's in-place ops do, so autograd refuses a backward through a graph
that saved a tensor the step has since changed, exactly where torch.optim's step makes it
refuse. Before, mpfused's step changed params in place unseen and such a backward silently
used the new values."""
import pytest
import torch

import mpfused
from mpfused.ops.registry import triton_usable

OPTIMIZERS = {
    "AdamW": (mpfused.AdamW, {}),
    "Adam-amsgrad": (mpfused.Adam, {"amsgrad": True}),
    "AdamW8bit": (mpfused.AdamW8bit, {"min_8bit_size": 16}),
    "AdamW4bit": (mpfused.AdamW4bit, {"min_8bit_size": 16}),
    "SGD-momentum": (mpfused.SGD, {"momentum": 0.9}),
    "SGD8bit": (mpfused.SGD8bit, {"momentum": 0.9, "min_8bit_size": 16}),
    "SGD4bit": (mpfused.SGD4bit, {"momentum": 0.9, "min_8bit_size": 16}),
    "Lion": (mpfused.Lion, {}),
    "Lion8bit": (mpfused.Lion8bit, {"min_8bit_size": 16}),
    "Lion4bit": (mpfused.Lion4bit, {"min_8bit_size": 16}),
}
MASTERS = ["fp32", "remainder", "none"]


def _backends():
    """The router's pick per op, an explicit reference, and explicit Triton under the
    interpreter (it writes through pointers: registry.Op._bump_written bumps for it)."""
    out = ["default", "reference"]
    return out + ["triton"] if triton_usable("cpu") else out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_step_bumps_what_it_writes(name, master, backend):
    """Params, masters and every state tensor of a stepped param: a higher version after the
    step (those the step changed are the ones torch's in-place step bumps too)."""
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16).bfloat16()
    extra = {} if backend == "default" else {"backend": backend}
    try:
        opt = cls(model.parameters(), lr=1e-2, master_weights=master, **kwargs, **extra)
    except ValueError as e:
        pytest.skip(f"{name} with master_weights={master!r}: {e}")
    for step in range(2):
        model(torch.randn(4, 32).bfloat16()).float().square().mean().backward()
        before = {id(t): t._version for t in _written(model, opt)}
        opt.step()
        opt.zero_grad()
        if step:
            for t in _written(model, opt):
                assert t._version > before[id(t)], (name, master, t.shape, t.dtype)


def _written(model, opt):
    out = list(model.parameters())
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_backward_through_a_stepped_param_is_refused_as_by_torch(name):
    """Forward, then a step (grads of an earlier backward), then the backward of that forward:
    torch.optim.AdamW's step makes autograd refuse it; mpfused's step must too."""
    def run(make_opt):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2))
        opt = make_opt(model.parameters())
        model(torch.randn(3, 8)).sum().backward()
        loss = model(torch.randn(3, 8)).sum()  # saves the second layer's weight
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    run(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    cls, kwargs = OPTIMIZERS[name]
    run(lambda ps: cls(ps, lr=1e-2, **kwargs))


def test_unscale_bumps_the_grads_as_torch_does():
    model = torch.nn.Linear(8, 8)
    opt = mpfused.AdamW(model.parameters())
    scaler = mpfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    before = [p.grad._version for p in model.parameters()]
    scaler.unscale_(opt)
    assert all(p.grad._version > v for p, v in zip(model.parameters(), before))


def test_inference_tensors_step_without_a_version():
    """Inference tensors have no version counter: stepped under inference mode they are left
    alone, as torch's in-place ops leave them."""
    with torch.inference_mode():
        p = torch.nn.Parameter(torch.randn(16))
        p.grad = torch.randn(16)
        opt = mpfused.AdamW([p], lr=1e-2)
        before = p.clone()
        opt.step()
    assert not torch.equal(before, p)
