"""Command line of `python -m mpfused.bench`."""
import argparse
import os
import time

import torch

from mpfused.bench.optimizers import FAMILIES
from mpfused.bench.presets import SIZE_PRESETS, default_size
from mpfused.bench.recipes import DEFAULT_RECIPES, RECIPES
from mpfused.bench.runner import DTYPES, BenchOptions, run_benchmark


def _recipe_list(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mpfused.bench",
        description="Train a small character-level GPT on the Python stdlib sources once per "
                    "mixed-precision recipe (same initial weights, same batches) and compare step "
                    "time, optimizer time, memory and loss.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZE_PRESETS),
                        help="model/batch preset (default: small on CPU, medium on CUDA)")
    parser.add_argument("--steps", type=int, help="training steps per recipe (default: preset's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="autocast dtype, also the weight dtype of the mpfused recipes")
    parser.add_argument("--recipes", type=_recipe_list, default=list(DEFAULT_RECIPES),
                        help=f"comma list from: {', '.join(RECIPES)} "
                             f"(default: {','.join(DEFAULT_RECIPES)})")
    parser.add_argument("--optimizer", choices=sorted(FAMILIES), default="adamw",
                        help="optimizer family of every recipe: torch's (native), mpfused's with "
                             "32-bit and 8-bit state, and the peers' 8-bit ones where they have it")
    parser.add_argument("--out", default="bench_out", help="folder for results.json and bench.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.size = args.size or default_size(torch.device(args.device).type)
    return args


def main(argv=None):
    """Run the benchmark; prints the table and writes results.json and bench.png. Returns results."""
    from mpfused.bench.plot import plot_results  # matplotlib only when actually plotting
    from mpfused.bench.report import format_table, write_json

    args = parse_args(argv)
    started = time.perf_counter()
    results = run_benchmark(BenchOptions(device=args.device, size=args.size, dtype=args.dtype,
                                         steps=args.steps, recipes=args.recipes, seed=args.seed,
                                         optimizer=args.optimizer))
    results["config"]["wall_seconds"] = round(time.perf_counter() - started, 1)
    os.makedirs(args.out, exist_ok=True)
    json_path = write_json(results, args.out)
    png_path = plot_results(results, args.out)
    print()
    print(format_table(results))
    print(f"\nwall time {results['config']['wall_seconds']} s; wrote {json_path} and {png_path}")
    return results
