"""Keeps `python -m mpfused.bench` from rotting: a tiny in-process run of every recipe.

torchao is left out of the end-to-end run because its AdamW8bit torch.compiles every step function
on first use (20-30 s on a CPU), which would blow this test's budget; `--recipes torchao` runs it."""
import json
import math
import types

import pytest
import torch

import mpfused
from mpfused.bench import main
from mpfused.bench.memory import training_state_bytes
from mpfused.bench.recipes import RECIPES

TEST_RECIPES = [name for name in RECIPES if name != "torchao"]


def test_bench_tiny_run_writes_every_recipe(tmp_path):
    main(["--device", "cpu", "--size", "tiny", "--steps", "6", "--recipes", ",".join(TEST_RECIPES),
          "--out", str(tmp_path), "--seed", "1"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    recipes = results["recipes"]
    assert list(recipes) == TEST_RECIPES
    for name, r in recipes.items():
        if r["status"] == "ok":
            assert math.isfinite(r["final_loss"]), name
            assert len(r["losses"]) == 6 and r["timed_steps"] == 6 - results["config"]["warmup_steps"]
            assert r["step_time_ms"] > 0 and 0 < r["optimizer_time_ms"] <= r["step_time_ms"]
            assert r["state_bytes"]["weights"] > 0
            # gradient release frees every grad in the backward: none left at the snapshot
            assert (r["state_bytes"]["grads"] == 0) == name.endswith("-release"), name
        else:
            assert r["status"] == "unavailable" and r["reason"], name

    native = recipes["native"]
    assert native["status"] == "ok" and native["final_loss_gap_pct"] == 0
    # our own recipes must run on the CPU: "unavailable" there would hide a crash
    for ours in ("mpfused", "mpfused-8bit", "mpfused-4bit"):
        assert recipes[ours]["status"] == "ok", recipes[ours].get("reason")
    # fp32 weights, grads, exp_avg and exp_avg_sq: 16 B/param (+ a few bytes of step counters).
    assert 16 <= native["state_bytes_per_param"]["total"] < 16.1
    # Untrained loss of a 128-way character model is about ln(128).
    assert abs(native["losses"][0] - math.log(128)) < 0.3


def test_state_bytes_count_shared_storage_once():
    model = torch.nn.Linear(8, 8, bias=False)
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model.weight]["alias"] = model.weight.detach()  # same storage as the weight
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    counted = training_state_bytes(model, optimizer, scaler)
    assert counted["weights"] == counted["grads"] == 8 * 8 * 4
    assert counted["optimizer_state"] == 0 and counted["total"] == 2 * 8 * 8 * 4


def test_bench_adamw8bit_tiny_run(tmp_path):
    """benchmarks/bench_adamw8bit.py end to end at a tiny size: every optimizer row, the
    bytes-moved limit, and mpfused's 8-bit state within the issue's 2.05 B/param."""
    from benchmarks.bench_adamw8bit import main as bench8

    path = bench8(["--device", "cpu", "--sizes", "3e5", "--rounds", "1", "--steps", "2",
                   "--warmup", "1", "--out", str(tmp_path)])
    result = json.loads(open(path).read())
    rows = {r["optimizer"]: r for r in result["results"]}
    assert {"mpfused.AdamW8bit", "torch.AdamW(fused)", "mpfused.AdamW"} <= set(rows)
    assert result["meta"]["device_type"] == "cpu"
    for name, r in rows.items():
        assert r["median_ms"] > 0 and r["x_limit"] > 0 and r["steps_timed"] == 2, name
        assert r["moved_bytes_per_param"] == (16 + 4 * 4 / 256 if "8bit" in name else 28), name
    assert rows["mpfused.AdamW8bit"]["state_bytes_per_param_large"] <= 2.05
    assert 8.0 <= rows["torch.AdamW(fused)"]["state_bytes_per_param_large"] < 8.01  # + step counters


def test_bench_release_tiny_run(tmp_path, monkeypatch):
    """benchmarks/bench_release.py end to end at a tiny size: both pairs timed, and each pair's
    models end bit-identical (the timed steps did the same work: release is exact here)."""
    import benchmarks.common
    from benchmarks.bench_release import PAIRS, main as bench_release

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    path = bench_release(["--size", "tiny", "--rounds", "4", "--warmup", "1", "--blocks", "2"])
    rows = {r["recipe"]: r for r in json.loads(open(path).read())["rows"]}
    assert set(rows) == {name for pair in PAIRS for name in pair}
    for _, release in PAIRS:
        assert rows[release]["same_params"] is True, release
        assert rows[release]["ratio_median"] > 0 and len(rows[release]["ratio_per_block"]) == 2
    assert all(r["median_ms"] > 0 and r["rounds"] == 4 for r in rows.values())


def test_bench_release_bucket_and_phases_tiny_runs(tmp_path, monkeypatch):
    """bench_release --bucket-kib tags its file and builds the release recipes with that bucket
    size (restored after); bench_release_phases times both pairs, whose models end equal."""
    import benchmarks.common
    from benchmarks.bench_release import main as bench_release
    from benchmarks.bench_release_phases import PAIRS, main as phases
    from mpfused.bench import recipes

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.setattr(recipes, "RELEASE_BUCKET_BYTES", recipes.RELEASE_BUCKET_BYTES)
    path = bench_release(["--size", "tiny", "--rounds", "2", "--warmup", "1", "--bucket-kib", "1"])
    assert "-1k-tiny" in str(path) and json.loads(open(path).read())["bucket_kib"] == 1
    out = phases(["--size", "tiny", "--rounds", "2", "--warmup", "1", "--bucket-kib", "1"])
    assert set(out) == {release for _, release in PAIRS}
    for release, row in out.items():
        assert row["same_params"] is True, release
        assert all(row[f"{r}_total_ms"] > 0 for pair in PAIRS for r in pair if release in pair)


def test_bench_release_solo_worker_and_buckets(capsys):
    """bench_release --processes' worker (--solo): one recipe alone prints its step times and
    the digest of its final params, equal for the ordinary and the release recipe (release is
    exact); bench_release_buckets times both pairs."""
    from benchmarks.bench_release import main as bench_release, quartiles
    from benchmarks.bench_release_buckets import main as buckets

    assert quartiles([2.0]) == (2.0, 2.0, 2.0)  # --processes 1: one median per recipe
    out = {}
    for name in ("mpfused", "mpfused-release"):
        bench_release(["--solo", name, "--size", "tiny", "--rounds", "2", "--warmup", "1"])
        out[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert len(out[name]["times"]) == 2 and out[name]["n_params"] > 0
    assert out["mpfused"]["digest"] == out["mpfused-release"]["digest"]
    buckets(["--reps", "2", "--pollute-mib", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("ratio" in line for line in lines[1:])


def test_bench_release_deferred_tiny_run(capsys, monkeypatch):
    """bench_release_deferred: the three recipes train, release and deferred end bit-identical
    (the deferral changes when, not what), and the release clocks ran."""
    from benchmarks import bench_release_deferred

    monkeypatch.setattr(bench_release_deferred, "WARMUP", 1)
    clocks = bench_release_deferred.main(["--rounds", "1"])
    assert "end bit-identical: True" in capsys.readouterr().out
    assert all(clocks[k] > 0 for k in ("in", "end", "native_in", "native_end", "step")), clocks


def test_bench_scaler_host_tiny_run():
    from benchmarks.bench_scaler_host import main as scaler_host
    row = scaler_host(["1"])
    assert set(row) == {"check_us", "raw_check_us", "unscale_us", "torch_us"}
    assert all(v > 0 for v in row.values())


@pytest.mark.parametrize("family,classes", [
    ("sgd", {"mpfused": "mpfused.SGD(", "mpfused-8bit": "mpfused.SGD8bit("}),
    ("lion", {"native": "TorchLion", "mpfused-8bit": "mpfused.Lion8bit("})])
def test_bench_optimizer_choice_tiny_run(tmp_path, family, classes):
    """`python -m mpfused.bench --optimizer sgd|lion` (issue 22): the same table and plot, each
    recipe built with the family's class (its result names it) and training (two recipes per
    family keep this short; test_bench_tiny_run_writes_every_recipe runs them all)."""
    main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--recipes", ",".join(classes),
          "--optimizer", family, "--out", str(tmp_path), "--seed", "1"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert list(results["recipes"]) == list(classes)
    for name, cls in classes.items():
        r = results["recipes"][name]
        assert r["status"] == "ok", (name, r.get("reason"))
        assert cls in r["optimizer"], (name, r["optimizer"])
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), name


def test_bench_release_fixed_tiny_run(capsys, monkeypatch):
    """bench_release_fixed: the three recipes train the nano char GPT and end bit-identical
    (the prepared calls change how a bucket is launched, not what it computes)."""
    from benchmarks import bench_release_fixed

    monkeypatch.setattr(bench_release_fixed, "WARMUP", 2)
    out = bench_release_fixed.main(["--rounds", "3"])
    assert out["same_params"] is True
    assert "all three end bit-identical: True" in capsys.readouterr().out
    assert all(out[k]["step"] > 0 for k in ("ordinary", "release", "release, no prepared calls"))


def test_bench_release_sweep_tiny_run(tmp_path, monkeypatch):
    """bench_release_sweep: every bucket size trains bit-identically to the ordinary recipe,
    smaller buckets keep fewer grads alive, the recipes' bucket size is restored."""
    import benchmarks.common
    from benchmarks import bench_release_sweep
    from mpfused.bench import recipes

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench_release_sweep, "WARMUP", 1)
    before = recipes.RELEASE_BUCKET_BYTES
    rows = bench_release_sweep.main(["--size", "tiny", "--rounds", "2", "--kib", "4", "64"])
    assert recipes.RELEASE_BUCKET_BYTES == before
    assert [r["bucket_kib"] for r in rows] == ["-", 4, 64]
    assert all(r["same_params"] for r in rows)
    assert rows[1]["buckets"] > rows[2]["buckets"] >= 1
    assert rows[1]["grads_alive_kib"] < rows[2]["grads_alive_kib"] <= rows[0]["grads_alive_kib"]


def test_bench_release_toggle_tiny_run(tmp_path, monkeypatch):
    """bench_release_toggle: the modes take turns on one model (release handles attached only
    for their steps: none is left attached) and smaller buckets keep fewer grads alive (the
    modes' equality: tests/test_release_reattach.py)."""
    import benchmarks.common
    from benchmarks import bench_release_toggle

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench_release_toggle, "WARMUP", 1)
    built = []
    real_build = bench_release_toggle.RECIPES["mpfused"].build

    def build(*a, **k):
        built.append(real_build(*a, **k))
        return built[-1]
    monkeypatch.setitem(bench_release_toggle.RECIPES, "mpfused",
                        types.SimpleNamespace(build=build))
    rows = bench_release_toggle.main(["--size", "tiny", "--rounds", "2", "--kib", "4", "64"])
    assert [r["mode"] for r in rows] == ["ordinary", "ordinary-b", "release 4 KiB",
                                         "release 64 KiB"]
    assert rows[2]["buckets"] > rows[3]["buckets"] >= 1
    assert rows[2]["grads_alive_kib"] < rows[3]["grads_alive_kib"] <= rows[0]["grads_alive_kib"]
    assert built[0].optimizer._grad_release is None


def test_bench_release_toggle_worker_modes(tmp_path, monkeypatch):
    """--workers: a release mode per bucket size and worker thread count; the worker mode's
    handle ran its releases on the worker."""
    import benchmarks.common
    from benchmarks import bench_release_toggle

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench_release_toggle, "WARMUP", 1)
    seen = []
    real = mpfused.step_in_backward

    def attach(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]
    monkeypatch.setattr(mpfused, "step_in_backward", attach)
    rows = bench_release_toggle.main(["--size", "tiny", "--rounds", "2", "--kib", "4",
                                      "--workers", "0", "1"])
    assert [r["mode"] for r in rows] == ["ordinary", "ordinary-b", "release 4 KiB",
                                         "release 4 KiB worker 1"]
    assert seen[0]._worker is None and seen[1]._worker[1].completed() > 0
    assert list(tmp_path.glob("release-toggle-worker-*"))


def test_bench_op_versions_tiny_run(tmp_path, monkeypatch):
    """bench_op_versions: both modes step the same optimizer; the bumps are what differs."""
    import benchmarks.common
    from benchmarks import bench_op_versions

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    rows = bench_op_versions.main(["--tensors", "50", "--numel", "8", "--rounds", "2"])
    assert [r["mode"] for r in rows] == ["bumps", "no bumps"] and rows[1]["ratio"] == 1.0
