"""The GPU run plan (benchmarks/gpu_suite.sh and what it calls) tested on CPU before it meets a GPU:
its syntax, its time caps against the device's 10-minute call, and a dry run of its control flow
(smoke processes, pytest with per-test deadlines and SIGINT, the archive, the file count, the
commit in every file). The GPU itself is not simulated: only the plumbing that would lose the
results of a scarce GPU run is."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
DEVICE_CALL_S = 600  # the device tool's limit for one command
DEVICE_FILES = 8     # files that come back from $OUT


def test_scripts_parse():
    for script in ("gpu_suite.sh", "cuda_torch_build.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_time_caps_fit_one_device_call():
    r = subprocess.run(["bash", str(SUITE), "--plan"], capture_output=True, text=True, check=True)
    phases = {}
    for line in r.stdout.splitlines():
        name, *fields = line.split()
        kv = dict(f.split("=") for f in fields if "=" in f)
        steps = {k: int(v) for k, v in (f.split(":") for f in fields if ":" in f)}
        phases[name] = (int(kv["total"]), int(kv["budget"]), steps)
    assert set(phases) == {"first", "verify", "sanitize", "roofline", "bench", "jobs"}
    for name, (total, budget, steps) in phases.items():
        assert "build" in steps and list(steps)[:2] == ["env", "build"], name  # a fresh machine may come
        # the caps (plus the archive's reserve) add up to the budget at most, and the budget leaves
        # the device call a margin for its own start-up and the transfer
        assert total <= budget <= DEVICE_CALL_S - 30, (name, total, budget)
    # the new kernels' steps are planned: the sanitizers' Triton pass, the SGD/Lion benchmark and
    # the main job per optimizer family
    # the one call of a 15-minute loan: every kernel against the CPU, then memcheck, then CUDA tests
    assert list(phases["first"][2])[2:] == ["smoke", "memcheck", "tests_cuda_short"]
    assert "memcheck_triton" in phases["sanitize"][2]
    assert "bench_sgd_lion" in phases["bench"][2]
    assert {"main_job", "main_job_sgd", "main_job_lion"} <= set(phases["jobs"][2])


def test_commit_stamp_is_not_tracked():
    # benchmarks/.commit must travel (untracked, not ignored) but never be committed: a committed
    # one would name the wrong commit on every later run
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "benchmarks/.commit"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/.commit"], cwd=ROOT).returncode == 0
    assert not tracked and not ignored


def test_ncu_csv_parse(tmp_path, capsys):
    from benchmarks.roofline import parse_ncu

    csv = tmp_path / "ncu.csv"
    csv.write_text('==PROF== Connected to process 1\n'
                   '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","dram__bytes_read.sum","byte","1,600"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","dram__bytes_write.sum","byte","1200"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","smsp__inst_executed_op_shared_ld.sum","inst","10"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum","","31"\n')
    k = parse_ncu(csv, 100)["void mta_kernel"]
    assert k["dram_bytes_per_elem"] == pytest.approx(28.0)
    assert k["shared_wavefronts_per_ld"] == pytest.approx(3.1)
    # the 8-bit Adam call: its prepare kernel is profiled too, and the stall reasons are ranked
    from benchmarks.roofline import STALL_PREFIX, STALL_SUFFIX, main as roof_main
    prep = '"1","void mpfused::cuda::q8::prepare_kernel<448>(Table, long)","x",'
    stall = lambda r, v: f'"0","void mta_kernel<Q8>(Meta)","WarpStateStats","{STALL_PREFIX}{r}{STALL_SUFFIX}","","{v}"\n'  # noqa: E731
    csv.write_text('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
                   '"0","void mta_kernel<Q8>(Meta)","x","dram__bytes_read.sum","byte","1000"\n'
                   + prep + '"dram__bytes_read.sum","byte","6"\n'
                   + stall("long_scoreboard", "7.5") + stall("barrier", "0.5") + stall("mio_throttle", "2"))
    ks = parse_ncu(csv, 100)
    assert set(ks) == {"void mta_kernel", "void mpfused::cuda::q8::prepare_kernel", "all kernels"}
    assert ks["all kernels"]["dram_bytes_per_elem"] == pytest.approx(10.06)
    assert list(ks["void mta_kernel"]["stall_top"]) == ["long_scoreboard", "mio_throttle", "barrier"]
    capsys.readouterr()
    assert roof_main(["--stall-metrics"]) == 0
    names = capsys.readouterr().out.strip().split(",")
    assert f"{STALL_PREFIX}long_scoreboard{STALL_SUFFIX}" in names and len(names) == len(set(names))
    # the suite filters on both kernel names and asks for the stall reasons
    text = SUITE.read_text()
    assert '"regex:mta_kernel|prepare_kernel"' in text and "--section WarpStateStats" in text
    csv.write_text('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","dram__bytes_read.sum","byte","1,600"\n'
                   '"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","x","dram__bytes_write.sum","byte","1200"\n')
    # as the suite calls it: merged into the roofline JSON next to what is there
    from benchmarks.roofline import main
    out = tmp_path / "roofline.json"
    out.write_text('{"kernels": []}')
    assert main(["--ncu-csv", str(csv), "--case", "adamw_fp32", "--numel", "100", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kernels"] == [] and data["ncu"]["adamw_fp32"]["numel"] == 100


def test_smoke_and_sanitizer_cases_run_on_cpu():
    """Every case of the smoke test and the sanitizer driver calls the ops as their schemas are
    now (a schema change must update the drivers here, not on the GPU)."""
    from benchmarks import gpu_smoke, sanitizer_driver
    from mpfused.ops import OPS

    backend = "native" if "native" in OPS["adam_step_"].available("cpu") else "reference"
    ran = set()
    for case in gpu_smoke.cases([backend]):
        if backend not in OPS[case[0]].available("cpu"):
            continue  # the worker's SKIP (test_dry_run checks that line)
        ok, err, note = gpu_smoke.run_case(case, "cpu")
        assert ok, (case, err, note)
        ran.add(case[0])
    assert {"sgd_step_", "lion_step_"} <= ran or backend == "reference"
    assert sanitizer_driver.main(["--device", "cpu", "--backends", backend]) == 0


def test_smoke_cases_cover_the_new_kernels():
    """Every SGD variant x dtype x master mode, every Lion dtype x mode, the 8-bit and 4-bit forms
    (SGD without the plain variant), the 4-bit Adam step, each on native and Triton, every master
    mode (remainder8 included: bf16); the new families judged bit for bit."""
    from benchmarks.smoke_cases import EXACT_FAMILIES, FAMILIES, cases
    from benchmarks.sanitizer_driver import EIGHT_BIT

    cs = cases(["native", "triton"])
    modes = lambda op, b: {(c[2], c[3]) for c in cs if c[0] == op and c[1] == b}  # noqa: E731
    for b in ("native", "triton"):
        assert len(modes("sgd_step_", b)) == 3 * 8 and len(modes("sgd8bit_step_", b)) == 2 * 8
        assert len(modes("lion_step_", b)) == 8 and len(modes("lion8bit_step_", b)) == 8
        assert len(modes("sgd4bit_step_", b)) == 2 * 8 and len(modes("lion4bit_step_", b)) == 8
        assert ("bf16", "nesterov/remainder") in modes("sgd_step_", b)
        for op in ("sgd8bit_step_", "sgd4bit_step_"):
            assert not any(m.startswith("plain/") for _, m in modes(op, b)), op
        for op in ("adam_step_", "adam8bit_step_", "adam4bit_step_"):
            assert len(modes(op, b)) == 8 and ("bf16", "remainder8") in modes(op, b), op
        assert ("bf16", "nesterov/remainder8") in modes("sgd_step_", b)
    # the 4-bit steps (Adam, SGD, Lion) run every block-size class in the sanitizer driver as the
    # 8-bit ones, and are in every sanitizer's op list and the ncu cases
    four = ("adam4bit_step_", "sgd4bit_step_", "lion4bit_step_")
    assert all(op in FAMILIES and op in EIGHT_BIT for op in four)
    text = SUITE.read_text()
    for ops in re.findall(r"^(?:ALL|SHARED)_OPS=(\S+)$", text, re.M):
        assert set(four) <= set(ops.split(",")), ops
    assert "tests/test_cuda_adam4bit.py" in text and "adamw4bit_fp32" in text
    assert "sgd4bit_fp32 lion4bit_fp32" in text and "--ignore=tests/test_cuda_one_state4bit.py" in text
    assert set(EXACT_FAMILIES) == {"sgd_step_", "lion_step_", "sgd8bit_step_", "lion8bit_step_",
                                   "sgd4bit_step_", "lion4bit_step_"}


_TESTS_CUDA = '''
import time
def test_passes(): pass
def test_fails(): assert 1 == 2
def test_hangs(): time.sleep(60)
'''
_TESTS_REST = '''
import faulthandler, signal, time
def test_before_interrupt(): pass
def test_interrupted():
    # a test whose deadline cannot fire: the step's cap (SIGINT) is the backstop
    signal.setitimer(signal.ITIMER_REAL, 0)
    faulthandler.cancel_dump_traceback_later()
    time.sleep(60)
'''


def test_dry_run(tmp_path):
    """The whole plan on CPU, in a copy of benchmarks/ (results written there, not in the repo),
    without .git (as on the device), the commit passed as on the device."""
    work = tmp_path / "tree"
    shutil.copytree(ROOT / "benchmarks", work / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__", ".commit"))
    (work / "dry_tests").mkdir()
    (work / "dry_tests" / "test_cuda_dry.py").write_text(_TESTS_CUDA)
    (work / "dry_tests" / "test_rest_dry.py").write_text(_TESTS_REST)
    out = tmp_path / "OUT"
    (out / "stale.txt").parent.mkdir()
    env = dict(os.environ, MPFUSED_COMMIT="0123456789abcdef0123", GPU_SUITE_TEST_DEADLINE="3",
               GPU_SUITE_SMOKE_ONLY="check_grads,sgd8bit_step_", GPU_SUITE_SAN_ONLY="update_scale_",
               GPU_SUITE_TESTS_CUDA="dry_tests/test_cuda_dry.py",
               GPU_SUITE_TESTS_REST="dry_tests/test_rest_dry.py", GPU_SUITE_CAP_tests_rest="8",
               # each step costs a process start-up (~5 s on 2 cores): these share memcheck's path,
               # ncu's CSV step is tested in test_ncu_csv_parse, the bench CLIs in test_bench
               GPU_SUITE_STUB="racecheck,synccheck,memcheck_triton,initcheck,ncu,bench_scaler,bench_adamw,"
                              "bench_8bit,bench_sgd_lion,main_job,main_job_sgd,main_job_lion",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path[1:]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(["bash", str(work / "benchmarks" / "gpu_suite.sh"), "--dry-run", str(out), "all"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    summary_txt = (out / "summary-all.txt").read_text()
    assert r.returncode == 1, r.stdout + r.stderr  # the planted failures fail the phase

    # two files come back: the archive (named after the commit) and the summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["mpfused-gpu-all-0123456789ab.tgz", "summary-all.txt"], files
    assert len(files) <= DEVICE_FILES

    lines = summary_txt.splitlines()
    assert lines[1].startswith("commit 0123456789abcdef0123"), lines[:3]
    verdict = {m.group(2): m.group(1) for m in map(re.compile(r"^(PASS|FAIL|TIMEOUT|SKIP)\s+(\S+)").match, lines) if m}
    assert verdict == {"env": "PASS", "build": "PASS", "smoke": "PASS", "tests_cuda": "FAIL",
                       "tests_rest": "TIMEOUT", "memcheck": "PASS", "racecheck": "PASS",
                       "synccheck": "PASS", "memcheck_triton": "PASS", "initcheck": "PASS",
                       "roofline": "PASS", "ncu": "PASS", "wheels": "SKIP", "bench_scaler": "PASS",
                       "bench_adamw": "PASS", "bench_8bit": "PASS", "bench_sgd_lion": "PASS",
                       "main_job": "PASS", "main_job_sgd": "PASS", "main_job_lion": "PASS"}, summary_txt
    # the steps' own tallies: the smoke's counts (naming an op without a kernel here), the
    # sanitizer driver's calls
    from mpfused.ops import OPS
    q8 = "native" in OPS["sgd8bit_step_"].available("cpu")
    tally = [ln for ln in lines if ln.strip().startswith("smoke: ")]
    assert len(tally) == 1 and "0 FAIL" in tally[0], summary_txt
    assert q8 or "no kernel on cpu: sgd8bit_step_ native" in tally[0], tally
    assert any(ln.strip().startswith("sanitizer driver: ") and " calls on cpu" in ln for ln in lines)

    with tarfile.open(out / "mpfused-gpu-all-0123456789ab.tgz") as tar:
        names = set(tar.getnames())
        read = lambda n: tar.extractfile(f"run-all/{n}").read().decode()  # noqa: E731
        for log in [n for n in names if n.endswith(".log")]:
            first = tar.extractfile(log).read().decode().splitlines()[0]
            assert first.startswith("# commit 0123456789abcdef0123"), (log, first)
        # smoke: one line per case, each PASS, each op family in its own process
        smoke = read("smoke.txt").splitlines()
        assert smoke[0].startswith("# commit 0123456789abcdef0123"), smoke[0]
        smoke = smoke[1:]
        assert smoke[-1].startswith("smoke: all PASS"), smoke[-1]
        smoke = smoke[:-1]
        assert len([s for s in smoke if " check_grads " in s]) == 3, smoke
        assert all(s.startswith("PASS") for s in smoke if " check_grads " in s), smoke
        # an op without a kernel for the backend: one SKIP line per case, not a failure
        q8 = [s for s in smoke if " sgd8bit_step_ " in s]
        assert len(q8) == 16 and all(s.startswith("PASS" if OPS["sgd8bit_step_"].native_available("cpu")
                                                  else "SKIP") for s in q8), q8
        # a hanging test fails by name at its deadline and the run goes on
        cuda = {c.get("name"): c for c in ET.fromstring(read("junit-cuda.xml")).iter("testcase")}
        assert set(cuda) == {"test_passes", "test_fails", "test_hangs"}
        assert cuda["test_passes"].find("failure") is None
        assert "deadline" in cuda["test_hangs"].find("failure").get("message")
        assert ET.fromstring(read("junit-cuda.xml")).find("testsuite").get("name") == "mpfused-0123456789ab"
        # the step's own cap interrupts with SIGINT: what finished is still named
        rest_log = read("tests_rest.log")
        assert "PASSED dry_tests/test_rest_dry.py::test_before_interrupt" in rest_log
        assert "KeyboardInterrupt" in rest_log
        rest = {c.get("name") for c in ET.fromstring(read("junit-rest.xml")).iter("testcase")}
        assert "test_before_interrupt" in rest
        # the roofline ran its CPU stand-in; JSONs carry the commit
        roof = json.loads(read("roofline.json"))
        kern = {k["case"]: k for k in roof["kernels"]}
        assert set(kern) == {"adamw_fp32", "adamw8bit_fp32", "adamw4bit_fp32", "check_bf16",
                             "sgd_fp32", "sgd_momentum_fp32", "lion_fp32", "sgd8bit_fp32",
                             "sgd4bit_fp32"}
        # the bytes-moved models: AdamW 28, SGD 12 / 20 with momentum, Lion 20 (fp32)
        assert [kern[c]["bytes_per_elem"] for c in ("adamw_fp32", "sgd_fp32", "sgd_momentum_fp32",
                                                    "lion_fp32")] == [28.0, 12.0, 20.0, 20.0]
        assert ("skipped" in kern["sgd8bit_fp32"]) != OPS["sgd8bit_step_"].native_available("cpu")
        if "skipped" not in kern["adamw4bit_fp32"]:  # 4-bit: 14 B + the absmax (two per 256)
            assert kern["adamw4bit_fp32"]["bytes_per_elem"] == pytest.approx(14 + 16 / 256)
        if "skipped" not in kern["sgd4bit_fp32"]:  # 4-bit SGD: 13 B + the absmax (one per 256)
            assert kern["sgd4bit_fp32"]["bytes_per_elem"] == pytest.approx(13 + 8 / 256)
        assert {(s["case"].split("_")[0], s["who"]) for s in roof["small_step"]} == {
            ("adamw", "mpfused"), ("adamw", "torch-fused"), ("sgd", "mpfused"),
            ("sgd", "torch-fused"), ("lion", "mpfused"), ("adamw8bit", "mpfused"),
            ("adamw4bit", "mpfused"), ("sgd8bit", "mpfused"), ("lion8bit", "mpfused"),
            ("sgd4bit", "mpfused"), ("lion4bit", "mpfused")}
        assert roof["suite_provenance"].startswith("commit 0123456789abcdef0123")
    # nothing was written outside OUT but the copy's own results folder
    assert not (work / "gpu_out").exists()
