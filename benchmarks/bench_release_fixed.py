"""Gradient release's fixed cost per training step, where the kernels cost nothing: the main job's
char GPT with its 41 param tensors (3 layers, 4 heads) but d_model 16, context 8 and one sequence
per batch, so that what is left of a step is Python, dispatch and the autograd engine. Release
buckets are sized to give about as many as the main job's small model has (7 of its 256 KiB).
Unlike ``bench_release_host`` (tiny params whose grads all arrive back to back: the release's
code runs hot), the model's backward ops run between the buckets, as in training, so each
bucket's release runs cold (its code and data evicted by the ops in between).

Three recipes, alternating step by step in one process (the order changing every round):
ordinary (``loss.backward(); opt.step()``), release, and release with its prepared calls
switched off (every bucket through ``BucketUpdate._update``: a patch of that handle, as before
the prepared calls). Reported per recipe: the medians of forward, backward, the rest of the step
(scaler.step, update, zero_grad) and the whole step; per release recipe the paired median of
its step less the ordinary step's (its fixed overhead per step). All three end bit-identical.

    python -m benchmarks.bench_release_fixed [--pair mpfused] [--rounds 900] [--threads 2]
"""
from __future__ import annotations

import argparse
import functools
import statistics

import torch

from benchmarks.common import machine, round_robin, timed_train_step
from mpfused.bench import recipes
from mpfused.bench.data import VOCAB_SIZE
from mpfused.bench.model import CharGPT, GPTConfig
from mpfused.bench.recipes import RECIPES

WARMUP = 50
PHASES = ("forward", "backward", "rest", "step")


def build(pair: str, buckets: int) -> tuple[dict, torch.Tensor, torch.Tensor, int]:
    torch.manual_seed(0)
    base = CharGPT(GPTConfig(vocab_size=VOCAB_SIZE, context_length=8, n_layer=3, n_head=4,
                             d_model=16))
    grad_bytes = sum(p.numel() * 2 for p in base.parameters())
    recipes.RELEASE_BUCKET_BYTES = grad_bytes // buckets + 1  # read by the release builds
    hp = recipes.Hyperparameters(lr=1e-3)
    cpu = torch.device("cpu")
    setups = {"ordinary": RECIPES[pair].build(base, cpu, torch.bfloat16, hp),
              "release": RECIPES[pair + "-release"].build(base, cpu, torch.bfloat16, hp),
              "release, no prepared calls": RECIPES[pair + "-release"].build(
                  base, cpu, torch.bfloat16, hp)}
    unprepared = setups["release, no prepared calls"].optimizer._grad_release
    unprepared._prepare_calls = lambda device: None  # every bucket through _update
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB_SIZE, (1, 8), generator=gen)
    y = torch.randint(0, VOCAB_SIZE, (1, 8), generator=gen)
    return setups, x, y, len(setups["release"].optimizer._grad_release._chunks)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="mpfused",
                    choices=["mpfused", "mpfused-8bit-remainder"])
    ap.add_argument("--rounds", type=int, default=900)
    ap.add_argument("--buckets", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setups, x, y, n_buckets = build(args.pair, args.buckets)

    def step(name):
        t0, t1, t2, t3 = timed_train_step(setups[name], x, y)
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0
    names = list(setups)
    times = round_robin({n: functools.partial(step, n) for n in names}, args.rounds, WARMUP)
    m = machine()
    print(f"{m['cpu']}, {torch.get_num_threads()} threads, torch {m['torch']}, commit "
          f"{m['commit']}; {args.pair}, {n_buckets} release buckets, {args.rounds} rounds")
    out = {}
    for n in names:
        cols = list(zip(*times[n]))
        out[n] = {ph: 1e6 * statistics.median(c) for ph, c in zip(PHASES, cols)}
        line = "  ".join(f"{ph} {out[n][ph]:7.1f} us" for ph in PHASES)
        if n != "ordinary":
            extra = 1e6 * statistics.median(
                [b[3] - a[3] for a, b in zip(times["ordinary"], times[n])])
            out[n]["overhead"] = extra
            line += f"   overhead {extra:6.1f} us/step ({extra / n_buckets:5.1f} us/bucket)"
        print(f"  {n:<28} {line}")
    models = [list(setups[n].model.parameters()) for n in names]
    same = all(all(torch.equal(a, b) for a, b in zip(models[0], other)) for other in models[1:])
    print(f"  all three end bit-identical: {same}")
    out["same_params"] = same
    return out


if __name__ == "__main__":
    main()
