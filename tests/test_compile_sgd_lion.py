"""torch.compile over SGD, Lion, SGD8bit and Lion8bit (issue 22), as tests/test_compile.py does
for AdamW: ``torch.compile(opt.step, fullgraph=True)`` traces the step with the native kernel as
one op in the graph, equal to eager bit for bit, with a tensor lr driven by an LR scheduler and
two graphs in all (before and after the state exists: no recompile across steps or LR changes);
the scaler's step and update compiled (they run eagerly behind graph breaks) equal eager, a
skipped (inf) step included."""
import pytest
import torch
from torch._dynamo.utils import counters

import mpfused
from tests.test_compile import _model, _state


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


SGD_KW = dict(momentum=0.9, nesterov=True)
CASES = {  # name: (class, kwargs, the op the step launches)
    "sgd-bf16-fp32-master-clipped": (mpfused.SGD, dict(SGD_KW, max_grad_norm=0.1), "sgd_step_"),
    "sgd-bf16-no-momentum-stochastic": (mpfused.SGD, dict(master_weights="none"), "sgd_step_"),
    "lion-bf16-stochastic-maximize": (mpfused.Lion, dict(master_weights="none", maximize=True),
                                      "lion_step_"),
    "sgd8bit": (mpfused.SGD8bit, dict(SGD_KW, min_8bit_size=256), "sgd8bit_step_"),
    "lion8bit": (mpfused.Lion8bit, dict(min_8bit_size=256), "lion8bit_step_"),
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
@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_optimizer_step_equals_eager(case):
    """No graph break, equal to eager bit for bit (params, masters, momentum / moment, 8-bit
    codes and absmax, steps), and two graphs in all."""
    cls, kwargs, _ = CASES[case]  # whichever kernel the router registered: one opaque node
    eager = _optimizer_loop(False, cls, kwargs)
    compiled = _optimizer_loop(True, cls, kwargs)
    assert len(eager) == len(compiled)
    if cls is mpfused.SGD8bit or cls is mpfused.Lion8bit:
        assert any(t.dtype == torch.uint8 for t in compiled)  # 8-bit state was traced
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def _scaler_loop(compiled, cls, kwargs, scaler_cls, steps=4, inf_at=2):
    model = _model(torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
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


SCALER_CASES = {
    "sgd-torch-dampening": (mpfused.SGD, dict(momentum=0.9, dampening=0.3),
                            torch.amp.GradScaler),
    "lion-mpfused-clipped": (mpfused.Lion, dict(max_grad_norm=0.05), mpfused.GradScaler),
    "sgd8bit-mpfused-clipped": (mpfused.SGD8bit, dict(SGD_KW, min_8bit_size=256,
                                                      max_grad_norm=0.05), mpfused.GradScaler),
    "lion8bit-torch": (mpfused.Lion8bit, dict(min_8bit_size=256, master_weights="remainder"),
                       torch.amp.GradScaler),
}


@pytest.mark.parametrize("case", list(SCALER_CASES))
def test_compiled_scaler_step_and_update_equal_eager(case):
    cls, kwargs, scaler_cls = SCALER_CASES[case]
    eager = _scaler_loop(False, cls, kwargs, scaler_cls)
    compiled = _scaler_loop(True, cls, kwargs, scaler_cls)
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
