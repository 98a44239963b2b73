"""torch.compile over mpfused's scaler and optimizers (issue 20, defect 4): compiled equals eager
bit for bit. ``scaler.step`` / ``update`` / ``unscale_`` run eagerly behind graph breaks, as torch's
GradScaler's do; ``torch.compile(opt.step, fullgraph=True)`` traces the step with its op as one
opaque node in the graph (fake kernels), whichever kernel the router registered for it (native,
Triton, reference), without a graph break and with two graphs in all (before and after the state
exists)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import mpfused
from mpfused.ops import OPS


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 72), torch.nn.ReLU(),
                               torch.nn.Linear(72, 8)).to(dtype)


def _state(opt):
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _scaler_loop(compiled, scaler_cls, opt_kwargs, steps=4, inf_at=2):
    model = _model(torch.bfloat16)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=1)

    def step_and_update():
        scaler.step(opt)
        scaler.update()

    run = torch.compile(step_and_update) if compiled else step_and_update
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(5, 32, generator=gen).bfloat16()
        scaler.scale(model(x).float().square().mean()).backward()
        if i == inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        run()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + _state(opt) + [scaler._scale]


@pytest.mark.parametrize("scaler_cls", [mpfused.GradScaler, torch.amp.GradScaler],
                         ids=["mpfused", "torch"])
@pytest.mark.parametrize("opt_kwargs", [{}, {"max_grad_norm": 0.05}], ids=["plain", "clipped"])
def test_compiled_scaler_step_and_update_equal_eager(scaler_cls, opt_kwargs):
    if scaler_cls is torch.amp.GradScaler and opt_kwargs:
        pytest.skip("torch's scaler hands no clipping norm: mpfused.AdamW computes its own")
    eager = _scaler_loop(False, scaler_cls, opt_kwargs)
    compiled = _scaler_loop(True, scaler_cls, opt_kwargs)
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def _train_loop(compiled, steps=3):
    model = _model(torch.float32)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)

    def train_step(x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    # aot_eager: forward and backward traced without inductor's re-fusion, so eager's rounding
    # and a bit-exact comparison; the scaler and optimizer behave the same under inductor.
    run = torch.compile(train_step, backend="aot_eager") if compiled else train_step
    gen = torch.Generator().manual_seed(2)
    losses = [run(torch.randn(5, 32, generator=gen)) for _ in range(steps)]
    return [p.detach().clone() for p in model.parameters()] + _state(opt) + losses


def test_compiled_train_step_with_backward_equals_eager():
    """forward, backward, scaler.step, update and zero_grad in one compiled function (this used
    to fail with "No inf checks were recorded prior to update")."""
    eager, compiled = _train_loop(False), _train_loop(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


FULLGRAPH_CASES = {
    "bf16-fp32-master-clipped": (mpfused.AdamW, dict(max_grad_norm=0.1)),
    "bf16-remainder": (mpfused.AdamW, dict(master_weights="remainder")),
    "bf16-stochastic-rounding": (mpfused.AdamW, dict(master_weights="none")),
    "8bit": (mpfused.AdamW8bit, dict(min_8bit_size=256)),
}


def _optimizer_loop(compiled, cls, kwargs, steps=4):
    model = _model(torch.bfloat16)
    opt = cls(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, **kwargs)
    # compiled before the scheduler wraps opt.step (its wrapper lives in a file dynamo skips);
    # the scheduler writes the tensor lr in place, which the graph reads
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()] + _state(opt)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("case", list(FULLGRAPH_CASES))
def test_fullgraph_optimizer_step_equals_eager(case):
    """torch.compile(opt.step, fullgraph=True): no graph break, equal to eager bit for bit
    (params, masters, moments, codes, steps), with a tensor lr driven by an LR scheduler, and
    two graphs in all (the first step makes the state, the next ones find it)."""
    cls, kwargs = FULLGRAPH_CASES[case]
    eager = _optimizer_loop(False, cls, kwargs)
    compiled = _optimizer_loop(True, cls, kwargs)
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert counters["stats"]["unique_graphs"] <= 2


def test_compiled_step_then_eager_step_replans():
    """Compiled steps keep no plans; an eager step after them builds its own from the state the
    compiled steps updated (equal to an all-eager run)."""
    runs = []
    for compiled_first in (False, True):
        model = _model(torch.bfloat16)
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(4)
        compiled = torch.compile(opt.step) if compiled_first else opt.step
        for step in (opt.step, compiled, compiled, opt.step):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            step()
        runs.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


FULLGRAPH_ROUTED = r"""
import json, torch
from torch._dynamo.utils import counters
from mpfused.ops import OPS
from tests.test_compile import FULLGRAPH_CASES, _optimizer_loop
cls, kwargs = FULLGRAPH_CASES[__CASE__]
eager, compiled = _optimizer_loop(False, cls, kwargs), _optimizer_loop(True, cls, kwargs)
print(json.dumps({"route": OPS[__OP__].route("cpu"),
                  "equal": all(torch.equal(a, b) for a, b in zip(eager, compiled)),
                  "graphs": counters["stats"]["unique_graphs"]}))
"""
ROUTED = {"reference": ({"MPFUSED_BACKEND": "reference"}, "8bit", "adam8bit_step_"),
          "triton": ({"MPFUSED_BACKEND": "triton", "TRITON_INTERPRET": "1"},
                     "bf16-fp32-master-clipped", "adam_step_")}


def test_fullgraph_with_triton_or_reference_registered():
    """With Triton or the reference registered as the CPU kernel (fresh processes, in parallel),
    ``fullgraph=True`` still traces (no graph break: the op is opaque whatever its kernel) and the
    compiled steps equal the eager ones bit for bit."""
    procs = {k: subprocess.Popen([sys.executable, "-c", FULLGRAPH_ROUTED.replace(
                                     "__CASE__", repr(case)).replace("__OP__", repr(op))],
                                 cwd=Path(__file__).resolve().parents[1], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, **env})
             for k, (env, case, op) in ROUTED.items()}
    for backend, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"route": backend, "equal": True, "graphs": 2}, (backend, result)
