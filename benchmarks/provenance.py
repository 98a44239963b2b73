"""Which source a GPU run measured, without `.git` (the device gets a copy of the working tree).

Here, before the device call:      python -m benchmarks.provenance write
    writes benchmarks/.commit: the commit, whether the tree had uncommitted changes, and a hash of
    the source files. The file is untracked and not ignored, so the device copy carries it.
There (gpu_suite.sh):              python -m benchmarks.provenance show
    prints one line: the commit (MPFUSED_COMMIT wins over the file), and whether the source
    hash there equals the one written here (it differs if files changed after `write`).
                                   python -m benchmarks.provenance stamp DIR LINE
    names the run in every JSON (key "suite_provenance"; a "commit" of "unknown" is replaced),
    CSV (a "suite_commit" column) and .txt (a first line) under DIR; the suite's logs start with
    the line already.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ROOT / "benchmarks" / ".commit"
# what the run's results depend on; build outputs and results are not source
SOURCE_DIRS = ("csrc", "mpfused", "triton_kernels", "tests", "benchmarks")
SOURCE_FILES = ("setup.py", "pyproject.toml")
SOURCE_SUFFIXES = {".py", ".cpp", ".cu", ".cuh", ".h", ".sh", ".toml"}


def _candidates(root: Path) -> list[Path]:
    # with git: the files that travel to the device (tracked, and untracked but not ignored);
    # without (on the device): every file, which there is the same set plus build outputs
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *SOURCE_DIRS,
                              *SOURCE_FILES], cwd=root, capture_output=True, text=True, check=True)
        return [root / f for f in out.stdout.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return [root / f for f in SOURCE_FILES] + [p for d in SOURCE_DIRS for p in (root / d).rglob("*")]


def tree_hash(root: Path = ROOT) -> str:
    files = [p for p in _candidates(root) if p.is_file() and (p.suffix in SOURCE_SUFFIXES
             or p.name in SOURCE_FILES) and "__pycache__" not in p.parts
             and "results" not in p.relative_to(root).parts]
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def write() -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout.strip()
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    info = {"commit": git("rev-parse", "HEAD"), "dirty_files": len(dirty),
            "tree_hash": tree_hash()}
    STAMP.write_text(json.dumps(info) + "\n")
    return info


def read() -> dict:
    info = json.loads(STAMP.read_text()) if STAMP.is_file() else {}
    env = os.environ.get("MPFUSED_COMMIT", "")
    if env and not info.get("commit", "").startswith(env):  # the command's commit wins
        info = {"commit": env}
    return info


def line() -> str:
    info = read()
    if not info.get("commit"):
        return f"commit unknown (no MPFUSED_COMMIT, no benchmarks/.commit)  tree {tree_hash()}"
    out = f"commit {info['commit']}"
    if "tree_hash" in info:
        now = tree_hash()
        out += (f"  dirty_files {info['dirty_files']}  tree {now} "
                + ("(= the stamped tree)" if now == info["tree_hash"]
                   else f"(CHANGED since stamped {info['tree_hash']})"))
    else:
        out += f"  tree {tree_hash()}"
    return out


def stamp(folder: Path, text: str) -> int:
    """Name the run in every JSON and CSV under folder; returns how many files were stamped."""
    commit = text.split()[1] if text.startswith("commit ") else "unknown"
    n = 0
    for p in sorted(folder.rglob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(data, dict):
            data["suite_provenance"] = text
            for sub in [data] + [v for v in data.values() if isinstance(v, dict)]:
                if sub.get("commit") in ("unknown", None) and "commit" in sub:
                    sub["commit"] = commit
        else:
            data = {"suite_provenance": text, "data": data}
        p.write_text(json.dumps(data, indent=1))
        n += 1
    for p in sorted(folder.rglob("*.txt")):  # plain reports: the line on top
        body = p.read_text(errors="replace")
        if not body.startswith(("# commit", "mpfused GPU suite")):
            p.write_text(f"# {text}\n{body}")
            n += 1
    for p in sorted(folder.rglob("*.csv")):
        with p.open(newline="") as f:
            rows = list(csv.reader(f))
        if not rows or "suite_commit" in rows[0]:
            continue
        rows = [rows[0] + ["suite_commit"]] + [r + [commit] for r in rows[1:]]
        with p.open("w", newline="") as f:
            csv.writer(f).writerows(rows)
        n += 1
    return n


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "show"
    if cmd == "write":
        print(json.dumps(write()))
    elif cmd == "show":
        print(line())
    elif cmd == "stamp":
        print(f"stamped {stamp(Path(sys.argv[2]), sys.argv[3])} files")
    else:
        sys.exit("usage: python -m benchmarks.provenance write|show|stamp DIR LINE")
