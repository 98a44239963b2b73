"""Precision against float64: every backend's fp32 Adam(W) is as close to a float64 run as torch's
own fp32 optimizer (issue 20, defect 1).

At lr=1 the update of a step is about lr, so an error in a per-step constant shows directly in the
params: 1 - beta2 taken from the fp32-rounded beta2 is off by up to 3e-3 relative at
beta2 = 0.99999, and made the fp32 error 20-5800x torch's. At lr=1e-3 the same error hides below
the fp32 tolerances, so these runs use lr=1. The bar is torch.optim.AdamW(foreach=False) in fp32
on the same run (tests/tolerances.py: PRECISION_VS_TORCH says why the factor).

AdamW8bit's kernels share the scalars: with params and grads constant over each quantization block
and a positive effective grad (L2 term included: params stay in [10, 30]), each block's moments are
+absmax, which encodes as the map's 1.0 and decodes exactly (absmax * 1.0), so an 8-bit run is an
exact fp32 Adam and meets the same bar.
"""
from __future__ import annotations

import functools

import pytest
import torch

import mpfused
from mpfused.ops import OPS
from tests.tolerances import PRECISION_VS_TORCH

N, STEPS, LR = 4096, 10, 1.0
BETA2S = (0.999, 0.9999, 0.99999)
# (name, decoupled, weight_decay): plain, AdamW with lr*wd = 0.1, Adam with L2
KINDS = (("adamw", True, 0.0), ("adamw-wd", True, 0.1), ("adam-l2", False, 0.1))
BLOCK, BLOCKS = 256, 32  # 8-bit runs: quantization blocks (distinct samples; few programs
# for the Triton interpreter, which runs one per block)


def _inputs(per_block: bool):
    """Initial params and STEPS grads (~1e-3), fp32 values (exact in float64), reproducible."""
    gen = torch.Generator().manual_seed(20)
    if per_block:  # constant over each quantization block, positive
        p0 = (torch.rand(BLOCKS, generator=gen) * 10 + 20).repeat_interleave(BLOCK)
        grads = [(torch.rand(BLOCKS, generator=gen) * 2e-3 + 1e-4).repeat_interleave(BLOCK)
                 for _ in range(STEPS)]
        return p0, grads
    p0 = torch.randn(N, generator=gen)
    return p0, [torch.randn(N, generator=gen) * 1e-3 for _ in range(STEPS)]


def _run(make_opt, dtype, per_block):
    p0, grads = _inputs(per_block)
    p = torch.nn.Parameter(p0.to(dtype))
    opt = make_opt([p])
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
    return p.detach().double()


def _torch_opt(decoupled, wd, beta2):
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return lambda ps: cls(ps, lr=LR, betas=(0.9, beta2), weight_decay=wd, foreach=False)


@functools.lru_cache(maxsize=None)
def _baseline(decoupled, wd, beta2, per_block):
    """(float64 params, torch fp32's mean error) of a run."""
    exact = _run(_torch_opt(decoupled, wd, beta2), torch.float64, per_block)
    fp32 = _run(_torch_opt(decoupled, wd, beta2), torch.float32, per_block)
    return exact, (fp32 - exact).abs().mean().item()


def mean_error(make_opt, decoupled, wd, beta2, per_block=False):
    """(mpfused's mean |p - p_float64|, torch fp32's) of the same run."""
    exact, torch_err = _baseline(decoupled, wd, beta2, per_block)
    got = _run(make_opt, torch.float32, per_block)
    return (got - exact).abs().mean().item(), torch_err


def _backends(op):
    return OPS[op].available("cpu")


@pytest.mark.parametrize("beta2", BETA2S)
@pytest.mark.parametrize("kind,decoupled,wd", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("backend", _backends("adam_step_"))
def test_adam_error_vs_float64_within_torch_fp32(backend, kind, decoupled, wd, beta2):
    cls = mpfused.AdamW if decoupled else mpfused.Adam
    err, bar = mean_error(lambda ps: cls(ps, lr=LR, betas=(0.9, beta2), weight_decay=wd,
                                         backend=backend), decoupled, wd, beta2)
    assert err <= PRECISION_VS_TORCH * bar, (
        f"{backend} {kind} beta2={beta2}: mean error {err:.3g} vs float64, torch fp32 {bar:.3g}")


# The interpreted Triton 8-bit kernel costs ~1 s a run: it gets the most sensitive beta2 only
# (its scalars are _adam_scalars.adam_scalars, which the fp32 runs above cover at every beta2).
_8BIT_CASES = [(b, beta2) for b in _backends("adam8bit_step_") for beta2 in BETA2S
               if b != "triton" or beta2 == BETA2S[-1]]


@pytest.mark.parametrize("backend,beta2", _8BIT_CASES, ids=[f"{b}-{x}" for b, x in _8BIT_CASES])
@pytest.mark.parametrize("kind,decoupled,wd", KINDS[1:], ids=[k[0] for k in KINDS[1:]])
def test_adam8bit_error_vs_float64_within_torch_fp32(backend, beta2, kind, decoupled, wd):
    cls = mpfused.AdamW8bit if decoupled else mpfused.Adam8bit
    err, bar = mean_error(
        lambda ps: cls(ps, lr=LR, betas=(0.9, beta2), weight_decay=wd, block_size=BLOCK,
                       min_8bit_size=1, decoupled_weight_decay=decoupled, backend=backend),
        decoupled, wd, beta2, per_block=True)
    assert err <= PRECISION_VS_TORCH * bar, (
        f"{backend} 8-bit {kind} beta2={beta2}: mean error {err:.3g} vs float64, torch fp32 "
        f"{bar:.3g}")
