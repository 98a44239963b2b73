"""The real-text training runs of the parity tests (mpfused.bench's run_benchmark), each recipe
trained once per test session.

run_benchmark trains every recipe from the same seeded initial weights on the same batches and
reseeds before each recipe (mpfused/bench/runner.py), so a recipe's result does not depend on
which other recipes share its call nor on their order (checked: alone, together and reversed give
the same losses, validation loss and state bytes, bf16 and fp16). The 200-step "mpfused"
reference (fp32 masters, 32-bit state), which the 8-bit, 4-bit and remainder8 parity tests each
compare with, is therefore trained once for all three instead of once per test."""
from __future__ import annotations

import dataclasses

import torch

from mpfused.bench.presets import SIZE_PRESETS
from mpfused.bench.recipes import RECIPES
from mpfused.bench.runner import BenchOptions, run_benchmark

# ((device, size preset, dtype, steps, seed, optimizer family, threads), recipe)
#   -> (result, optimizer)
_trained: dict = {}


def _key(opts: BenchOptions) -> tuple:
    # The preset itself (frozen, compared by value), not its name: tests patch the presets.
    # The thread count too: the matmuls' last bits depend on it.
    return (opts.device, SIZE_PRESETS[opts.size], opts.dtype, opts.steps, opts.seed,
            opts.optimizer, torch.get_num_threads())


def recipe_runs(opts: BenchOptions) -> tuple[dict, dict]:
    """({recipe: result}, {recipe: the optimizer it trained}) for opts.recipes, training only the
    recipes not yet trained under the same options. A result is run_benchmark's entry less
    final_loss_gap_pct (that is relative to a "native" run of the same call); do not modify it."""
    key = _key(opts)
    missing = [name for name in opts.recipes if (key, name) not in _trained]
    if missing:
        optimizers, builders = {}, {name: RECIPES[name] for name in missing}

        def capturing(name):
            def build(*args, _build=builders[name].build):
                setup = _build(*args)
                optimizers[name] = setup.optimizer
                return setup
            return dataclasses.replace(builders[name], build=build)

        try:
            for name in missing:
                RECIPES[name] = capturing(name)
            results = run_benchmark(dataclasses.replace(opts, recipes=missing),
                                    log=lambda *a: None)["recipes"]
        finally:
            RECIPES.update(builders)
        for name in missing:
            entry = dict(results[name])
            entry.pop("final_loss_gap_pct", None)
            _trained[(key, name)] = (entry, optimizers.get(name))
    runs = {name: _trained[(key, name)] for name in opts.recipes}
    return ({name: r for name, (r, _) in runs.items()},
            {name: o for name, (_, o) in runs.items()})
