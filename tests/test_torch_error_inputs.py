"""Constructor errors as torch's: torch's own error inputs for Adam and AdamW
(torch.testing._internal.common_optimizers.optim_db, ``optim_error_inputs_func``) run against
mpfused.Adam / AdamW / Adam8bit / AdamW8bit (and torch's SGD inputs against mpfused.SGD), asserting torch's exception type and message regex.

Deliberate exclusions (README, "Where mpfused.AdamW / Adam differ"):
* "a param group cannot have duplicate parameters": torch warns (UserWarning) and keeps the
  duplicate; mpfused warns the same and then raises ValueError, since its fused kernel would
  update the param twice. Pinned in test_duplicate_param_warns_then_raises.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import mpfused

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers",
                                        reason="torch's internal test inputs need expecttest")
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

# mpfused class -> the torch class whose error inputs it must pass
PAIRS = [(mpfused.Adam, torch.optim.Adam), (mpfused.AdamW, torch.optim.AdamW),
         (mpfused.Adam8bit, torch.optim.Adam), (mpfused.AdamW8bit, torch.optim.AdamW),
         (mpfused.SGD, torch.optim.SGD)]
EXCLUDED = {"a param group cannot have duplicate parameters"}


def _torch_error_inputs(torch_cls):
    info = next(i for i in common_optimizers.optim_db if i.optim_cls is torch_cls)
    inputs = list(info.optim_error_inputs_func(device="cpu", dtype=torch.float32))
    # torch lists these under its CUDA-only inputs (it builds them with a CUDA tensor), but its
    # checks are device-independent: the same inputs on CPU.
    sample = torch.nn.Parameter(torch.empty(()))
    Err, In = common_optimizers.ErrorOptimizerInput, common_optimizers.OptimizerInput
    inputs += [
        Err(In(params=[sample], kwargs={"foreach": True, "fused": True},
               desc="`fused` and `foreach` cannot be `True` together"),
            error_type=RuntimeError, error_regex="`fused` and `foreach` cannot be `True` together"),
        Err(In(params=[sample], kwargs={"fused": True, "differentiable": True},
               desc="`fused` does not support `differentiable`"),
            error_type=RuntimeError, error_regex="`fused` does not support `differentiable`"),
    ]
    return inputs


def _expect_error(cls, error_input):
    inp = error_input.optimizer_error_input
    call = (lambda: cls(inp.params, **inp.kwargs))
    if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
        opt = cls(inp.params, **inp.kwargs)
        call = opt.step
    if issubclass(error_input.error_type, Warning):
        with pytest.warns(error_input.error_type, match=error_input.error_regex):
            call()
    else:
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            call()


@pytest.mark.parametrize("cls,torch_cls", PAIRS, ids=lambda c: getattr(c, "__name__", ""))
def test_torch_error_inputs(cls, torch_cls):
    inputs = _torch_error_inputs(torch_cls)
    assert len(inputs) >= (9 if torch_cls is torch.optim.SGD else 12)  # torch's list was read
    for error_input in inputs:
        desc = error_input.optimizer_error_input.desc
        if desc in EXCLUDED:
            continue
        _expect_error(torch_cls, error_input)  # the expectation holds for torch itself
        try:
            _expect_error(cls, error_input)
        except BaseException as e:  # name the input that failed
            raise AssertionError(f"{cls.__name__}: torch error input {desc!r}: {e!r}") from e


@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.Adam8bit, mpfused.SGD, mpfused.Lion])
def test_duplicate_param_warns_then_raises(cls):
    p = torch.nn.Parameter(torch.randn(2))
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        with pytest.raises(ValueError, match="a parameter appears twice in one param group"):
            cls([p, p])


@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.Adam, mpfused.AdamW8bit])
@pytest.mark.parametrize("kwargs,error,message", [
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (dict(lr=torch.tensor([[1e-3]])), None, None),  # 1-element: accepted, as torch
    (dict(betas=(0.9, torch.tensor(0.99))), ValueError,
     "betas must be either both floats or both Tensors"),
    (dict(betas=(0, 0.99)), ValueError, "betas must be either both floats or both Tensors"),
    (dict(betas=(torch.tensor([0.9, 0.9]), torch.tensor(0.99))), RuntimeError,
     "Boolean value of Tensor with more than one value is ambiguous"),
    (dict(fused=True, foreach=True), RuntimeError,
     re.escape("`fused` and `foreach` cannot be `True` together.")),
    (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (dict(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
])
def test_constructor_errors_as_torch(cls, kwargs, error, message):
    """Exactly torch's exception type and full message (not only a regex), and the same
    acceptance."""
    torch_cls = torch.optim.Adam if cls is mpfused.Adam else torch.optim.AdamW

    def outcome(c):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                c([torch.nn.Parameter(torch.randn(2))], **kwargs)
            except Exception as e:
                return type(e), str(e)
        return None

    expected = outcome(torch_cls)
    assert (expected[0] if expected else None) is error
    if message is not None:
        assert re.search(message, expected[1])
    assert outcome(cls) == expected


@pytest.mark.parametrize("kwargs,message", [
    (dict(lr=float("inf")), "Invalid learning rate: inf"),
    (dict(eps=float("inf")), "Invalid epsilon value: inf"),
    (dict(weight_decay=float("inf")), "Invalid weight_decay value: inf"),
    (dict(lr=torch.tensor(float("inf"))), "Invalid learning rate: inf"),
    (dict(max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
])
def test_mpfused_rejects_non_finite_hyperparameters(kwargs, message):
    """Deliberate (README): torch takes an infinite lr / eps / weight_decay, mpfused refuses it."""
    with pytest.raises(ValueError, match=message):
        mpfused.AdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_tensor_betas_kept_as_torch():
    """Tensor betas are accepted, squeezed to 0-dim as torch keeps them, and step."""
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(p.detach().clone())
    betas = (torch.tensor([0.9]), torch.tensor([0.99]))
    ours, ref = mpfused.AdamW([p], betas=betas), torch.optim.AdamW([q], betas=betas)
    assert [b.shape for b in ours.defaults["betas"]] == [b.shape for b in ref.defaults["betas"]]
    for _ in range(3):
        p.grad = torch.ones(3)
        q.grad = torch.ones(3)
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q)
