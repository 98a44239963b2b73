"""The main job's model for the release benchmarks: the char GPT of `python -m mpfused.bench` at a
size preset, built from one seed, its hyperparameters, and the batches every recipe trains on
(the same sequence for all), as mpfused/bench/train.py makes them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mpfused.bench import recipes
from mpfused.bench.data import VOCAB_SIZE, batch_offsets, load_stdlib_corpus, make_batch
from mpfused.bench.model import CharGPT, GPTConfig
from mpfused.bench.presets import SIZE_PRESETS


@dataclass
class MainJob:
    base: torch.nn.Module       # initial weights every recipe copies
    hp: recipes.Hyperparameters
    corpus: object              # None when no batches were asked for
    offsets: list
    context_length: int

    def batch(self, i: int):
        """(inputs, targets) of batch i (cycling through the offsets)."""
        return make_batch(self.corpus.train, self.offsets[i % len(self.offsets)],
                          self.context_length)


def main_job(size: str = "small", seed: int = 0, n_batches: int = 0) -> MainJob:
    preset = SIZE_PRESETS[size]
    ctx = preset.context_length
    corpus = load_stdlib_corpus() if n_batches else None
    offsets = (batch_offsets(len(corpus.train), ctx, preset.batch_size, n_batches, seed)
               if n_batches else [])
    torch.manual_seed(seed)
    base = CharGPT(GPTConfig(vocab_size=VOCAB_SIZE, context_length=ctx, n_layer=preset.n_layer,
                             n_head=preset.n_head, d_model=preset.d_model))
    return MainJob(base, recipes.Hyperparameters(lr=preset.lr), corpus, offsets, ctx)
