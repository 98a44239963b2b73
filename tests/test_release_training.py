"""Gradient release (mpfused.step_in_backward, issue 23) on the real-text training run, the
bench's char GPT on the stdlib's sources under bf16 autocast: without clipping it gives the
ordinary step's losses exactly; clip='previous' (the global norm estimated inside the backward)
against exact clipping, within the parity tolerance, with the measured seed table."""
import copy

import torch

import mpfused


def test_char_gpt_release_equals_ordinary_bf16():
    """The real-text training run (the bench's char GPT on the stdlib's sources, bf16 autocast):
    the recipe with release gives the ordinary recipe's losses exactly, step for step."""
    from mpfused.bench.runner import BenchOptions, run_benchmark
    opts = BenchOptions(device="cpu", size="tiny", dtype="bf16", steps=30,
                        recipes=["mpfused", "mpfused-release"], seed=3)
    results = run_benchmark(opts, log=lambda *a: None)["recipes"]
    ordinary, released = results["mpfused"], results["mpfused-release"]
    assert ordinary["status"] == released["status"] == "ok", released.get("reason")
    assert released["optimizer"].endswith("step_in_backward")
    assert released["losses"] == ordinary["losses"]
    assert released["state_bytes"]["grads"] == 0 < ordinary["state_bytes"]["grads"]


CLIP_PARITY_TOLERANCE_PCT = 1.0  # the 8-bit state's parity tolerance (test_training_parity.py)


def test_char_gpt_previous_norm_clipping_parity():
    """clip='previous' against exact clipping (max_grad_norm on the ordinary step) on the char GPT
    (bf16 weights + fp32 masters, bf16 autocast, 120 steps at lr 1e-3, max_grad_norm 1.0, which
    clips most early steps; 64 KiB release buckets, 5 a step): final loss (mean of the last
    12 steps) within 1%.

    Measured on the 2-core CPU VM, final-loss gap to exact clipping in %, seed s = init and batch
    seed (this test: seed 0, max_grad_norm 1.0):
      max_grad_norm 1.0, seeds 0..7:
        seen + previous unseen (the rule) +0.31 +0.61 +0.15 +0.04 +0.43 +0.04 +0.58 -0.17
        max(previous norm, seen)          +0.19 +0.57 +0.12 +0.92 +0.73 -0.09 +0.47 -0.08
        previous norm alone (first rule)  +1.51 +0.41 +0.76 (seeds 0..2)
        no clipping                       +2.61 +1.26 +1.24 +2.40 +2.45 +1.05 +2.55 +2.15
      max_grad_norm 0.5, seeds 0..4:
        seen + previous unseen (the rule) +0.38 +0.53 -0.05 +0.10 +0.45
        max(previous norm, seen)          +0.16 +0.58 -0.01 +0.97 +0.74
        no clipping                       +2.65 +1.23 +1.16 +2.51 +2.41
    The rule: worst 0.61%, mean +0.26% over the 13 runs (max(previous, seen): worst 0.97%, mean
    +0.41%). It is not exact: the floor of this measure is ~0.03% (exact clipping with the int16
    remainder instead of the fp32 master, seeds 3, 4, 1: +0.03 -0.01 -0.02), so a small bias
    (clipping a bucket with a norm whose unseen part is last step's) remains. Not better: letting
    the first step only measure the norm (no update) moves the final loss by itself by up to 1%
    (exact clipping with the first step skipped, seeds 0..2: +0.36 -0.01 -1.02), and giving the
    first step the exact norm recovered only 0.08-0.26 points of max(previous, seen)'s gap
    (seeds 3, 4, 1). Broken rules fail the test: no clipping +2.61%, the previous norm alone
    +1.51% (seed 0)."""
    from mpfused.bench.data import VOCAB_SIZE, batch_offsets, load_stdlib_corpus, make_batch
    from mpfused.bench.model import CharGPT, GPTConfig
    corpus = load_stdlib_corpus()
    steps, ctx, batch = 120, 32, 8
    offsets = batch_offsets(len(corpus.train), ctx, batch, steps, 0)
    torch.manual_seed(0)
    base = CharGPT(GPTConfig(vocab_size=VOCAB_SIZE, context_length=ctx, n_layer=2, n_head=2,
                             d_model=64))
    finals = {}
    for release in (False, True):
        model = copy.deepcopy(base).bfloat16()
        opt = mpfused.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
        if release:
            mpfused.step_in_backward(opt, clip="previous", bucket_bytes=64 * 1024)
        losses = []
        for step in range(steps):
            inputs, targets = make_batch(corpus.train, offsets[step], ctx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        finals[release] = sum(losses[-12:]) / 12
    gap = 100 * (finals[True] - finals[False]) / finals[False]
    assert abs(gap) < CLIP_PARITY_TOLERANCE_PCT, (finals, gap)
