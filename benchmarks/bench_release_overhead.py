"""Gradient release's step-time overhead, before and after a change (issue 23): the per-round
ratio release / ordinary of whole training steps of the main job's char GPT
(``bench_release``'s timing: both recipes of a pair round-robin in one process, the order
changing every round, medians), for each source tree and torch thread count.

Two versions of mpfused cannot share a process (their ops register under one namespace), so
each (tree, threads) runs in its own child process; the children alternate between the trees
(before, after, before, after, ...) so that load that comes and goes on a shared machine hits
both. A tree is a checkout with its own built extension (``mpfused/_C*.so``); the children
import ``mpfused`` and ``benchmarks.bench_release`` from it.

    python -m benchmarks.bench_release_overhead --tree before=/path/to/old --tree after=. \\
        [--threads 1 2] [--repeats 2] [--rounds 40] [--out release-overhead]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, torch
from benchmarks.bench_release import PAIRS, make_steppers, time_round_robin
rounds, warmup, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
out = []
for ordinary, release in PAIRS:
    steppers, models, n = make_steppers("small", torch.bfloat16, [ordinary, release], 0,
                                        rounds + warmup)
    times = time_round_robin(steppers, rounds, warmup)
    ratios = [b / a for a, b in zip(times[ordinary], times[release])]
    same = all(torch.equal(a, b) for a, b in zip(models[ordinary].parameters(),
                                                 models[release].parameters()))
    out.append({"ordinary": ordinary, "release": release, "n_params": n,
                "ordinary_ms": 1e3 * statistics.median(times[ordinary]),
                "release_ms": 1e3 * statistics.median(times[release]),
                "ratios": ratios, "same_params": same})
print("RESULT " + json.dumps(out))
"""


def run_child(tree: Path, threads: int, rounds: int, warmup: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(rounds), str(warmup), str(threads)],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child in {tree} failed:\n{proc.stdout}\n{proc.stderr}")


def tree_commit(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="NAME=PATH of a built checkout (repeat; run in the order given)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2, help="children per (tree, threads)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="release-overhead")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    trees = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    runs = []  # (tree, threads, repeat, result of the child)
    for threads in args.threads:
        for rep in range(args.repeats):
            order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
            for name in order:
                load = os.getloadavg()
                res = run_child(trees[name], threads, args.rounds, args.warmup)
                runs.append({"tree": name, "threads": threads, "repeat": rep,
                             "load_average_before": load, "pairs": res})
                print(f"{name:>8} {threads}t rep {rep}: " + ", ".join(
                    f"{p['release']} {statistics.median(p['ratios']):.3f}x" for p in res),
                    flush=True)
                path = write(args, trees, runs)  # after every child: a partial run is kept
    for r in summarize(runs):
        print(f"{r['tree']:>8} {r['threads']}t {r['release']:>32}: {r['ratio_median']:.3f}x "
              f"(per child {r['ratio_median_per_child']}), same params {r['same_params']}")
    print(f"wrote {path}")


def summarize(runs: list) -> list[dict]:
    rows = []
    for threads in dict.fromkeys(r["threads"] for r in runs):
        for name in dict.fromkeys(r["tree"] for r in runs):
            mine = [r for r in runs if r["tree"] == name and r["threads"] == threads]
            if not mine:
                continue
            for k, pair in enumerate(mine[0]["pairs"]):
                ratios = [x for r in mine for x in r["pairs"][k]["ratios"]]
                rows.append({
                    "tree": name, "threads": threads, "release": pair["release"],
                    "ratio_median": statistics.median(ratios),
                    "ratio_median_per_child": [round(statistics.median(r["pairs"][k]["ratios"]),
                                                     4) for r in mine],
                    "ordinary_ms_per_child": [round(r["pairs"][k]["ordinary_ms"], 1)
                                              for r in mine],
                    "release_ms_per_child": [round(r["pairs"][k]["release_ms"], 1)
                                             for r in mine],
                    "same_params": all(r["pairs"][k]["same_params"] for r in mine),
                    "rounds": len(ratios)})
    return rows


def write(args, trees: dict, runs: list) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import write_results
    return write_results(args.out, "cpu", summarize(runs), extra={
        "trees": {n: {"path": str(p), "commit": tree_commit(p)} for n, p in trees.items()},
        "model": "char GPT, small preset (0.64M params), bf16 autocast, mpfused.GradScaler "
                 "disabled (bf16), release bucket 256 KiB",
        "method": "whole training steps (forward, backward, scaler.step, update, zero_grad); "
                  "per child both recipes of a pair round-robin, order changing every round; "
                  "ratio = release / ordinary per round; ratio_median over all rounds of all "
                  "children of the (tree, threads); children alternate between trees",
        "warmup": args.warmup, "note": args.note, "runs": runs})


if __name__ == "__main__":
    main()
