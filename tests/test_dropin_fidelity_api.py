"""Drop-in fidelity of the functions beside the optimizers (issue 20, items 10 and 11):
mpfused.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_, and mpfused.amp.setup with a
torch.optim class."""
from __future__ import annotations

import pytest
import torch

import mpfused
from mpfused import amp

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _params(dtypes, scale=1.0, seed=0, bad=None):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(50 + 13 * i, dtype=dt))
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(dt)
        if bad is not None and i == 0:
            p.grad[3] = bad
        ps.append(p)
    return ps


def _both(dtypes, max_norm, norm_type=2.0, **kw):
    """(torch's result, ours): (norm, grads after clipping, or the exception)."""
    out = []
    for fn in (torch.nn.utils.clip_grad_norm_, mpfused.clip_grad_norm_):
        ps = _params(dtypes, **{k: v for k, v in kw.items() if k in ("scale", "bad")})
        try:
            norm = fn(ps, max_norm, norm_type, **{k: v for k, v in kw.items()
                                                  if k in ("error_if_nonfinite", "foreach")})
        except Exception as e:  # noqa: BLE001 - compared below
            out.append((type(e), str(e)))
            continue
        out.append((norm, [p.grad for p in ps]))
    return out


@pytest.mark.parametrize("dtypes", [[BF16], [FP16], [FP32], [BF16, BF16], [BF16, FP32],
                                    [BF16, FP16], [FP16, FP32, BF16]],
                         ids=lambda d: "+".join(str(t).split(".")[1] for t in d))
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_clip_grad_norm_matches_torch(dtypes, max_norm, foreach):
    (t_norm, t_grads), (norm, grads) = _both(dtypes, max_norm, foreach=foreach)
    assert norm.dtype == t_norm.dtype and norm.device == t_norm.device and norm.shape == ()
    # ours sums all squares in fp32 (torch rounds each tensor's norm to its dtype first)
    torch.testing.assert_close(norm, t_norm, rtol=2 ** -7, atol=0)
    for g, tg in zip(grads, t_grads):
        assert g.dtype == tg.dtype
        torch.testing.assert_close(g, tg, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, "inf"])
def test_clip_grad_norm_other_norms_match_torch(norm_type):
    (t_norm, t_grads), (norm, grads) = _both([BF16, FP32], 0.5, norm_type)
    assert norm.dtype == t_norm.dtype
    assert torch.equal(norm, t_norm)


def test_clip_grad_norm_fp16_norm_overflow_as_torch():
    """fp16 grads whose 2-norm passes 65504: torch's fp16 norm is inf and the grads are scaled
    by max_norm / inf = 0; mpfused returns and does the same (the drop-in contract)."""
    (t_norm, t_grads), (norm, grads) = _both([FP16], 1.0, scale=1e4)
    assert torch.isinf(t_norm) and torch.isinf(norm) and norm.dtype == FP16
    assert all(torch.equal(g, tg) for g, tg in zip(grads, t_grads))


@pytest.mark.parametrize("dtypes", [[BF16], [FP16, FP32]])
def test_clip_grad_norm_error_if_nonfinite_as_torch(dtypes):
    theirs, ours = _both(dtypes, 1.0, bad=float("nan"), error_if_nonfinite=True)
    assert ours == theirs and theirs[0] is RuntimeError
    (t_norm, _), (norm, _) = _both(dtypes, 1.0, bad=float("inf"))
    assert norm.dtype == t_norm.dtype and torch.isinf(norm) and torch.isinf(t_norm)


def test_clip_grad_norm_without_grads_as_torch():
    for params in ([], [torch.nn.Parameter(torch.zeros(3, dtype=BF16))]):
        t_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        norm = mpfused.clip_grad_norm_(params, 1.0)
        assert norm.dtype == t_norm.dtype == FP32 and norm.item() == t_norm.item() == 0.0
    p = _params([BF16])[0]  # a single tensor, as torch takes it
    q = _params([BF16])[0]
    assert mpfused.clip_grad_norm_(p, 0.1).dtype == torch.nn.utils.clip_grad_norm_(q, 0.1).dtype


# ---- amp.setup with torch's optimizers -------------------------------------------------------
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_setup_takes_a_torch_optimizer_with_fp32_weights(cls):
    model, opt, scaler = amp.setup(_mlp(), optimizer=cls, dtype="fp32", lr=1e-2,
                                   weight_decay=0.0)
    assert type(opt) is cls and opt.defaults["lr"] == 1e-2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not scaler.is_enabled()
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs,match", [
    ({}, "keeps no fp32 master weights, so it needs fp32 weights"),  # dtype="auto": 16-bit
    ({"dtype": "bf16"}, "dtype resolves to torch.bfloat16"),
    ({"dtype": "fp32", "master_weights": "none"}, "master_weights='none' is an option of mpfused"),
    ({"dtype": "fp32", "master_weights": "remainder"}, "master_weights='remainder' is an option"),
])
def test_setup_refuses_a_torch_optimizer_on_16bit_weights(kwargs, match):
    model = _mlp()
    with pytest.raises(ValueError, match=match):
        amp.setup(model, optimizer=torch.optim.AdamW, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # untouched
