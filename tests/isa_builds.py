"""Every CPU ISA build bit-identical, for every family at once: one process per ISA.

The block-wise CPU kernels are built per ISA (baseline, x86-64-v3, v4, v4 + VBMI); the build a
process uses is picked once (csrc/cpu/quant8_cpu.cpp's isa_level(), capped by MPFUSED_CPU_ISA),
so each ISA needs its own process. Each family's test used to start its own four processes
(importing torch and mpfused each time, ~3 s of CPU apiece); here the first test that asks starts
four processes, one per ISA, each computing the digest of every family in FAMILIES whose test
module the session imported, in parallel, and every family's test compares its own four digests.

A family: `name: "module:function"`, function(seed) -> a hex digest of the bytes its kernels
wrote (run in the ISA's process; the module is imported there)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch

ISAS = ("base", "v3", "v4", "vbmi")
FAMILIES = {
    "adam8bit": "tests.test_adam8bit_kernels:isa_digest",
    "sgd_lion_8bit": "tests.test_sgd_lion_quant_determinism:isa_digest8",
    "adam4bit": "tests.test_adamw4bit:isa_digest",
    "sgd_lion_4bit": "tests.test_sgd_lion_quant_determinism:isa_digest4",
}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_results: dict | None = None


def _session_families(family: str) -> list[str]:
    """`family` and every other family whose test module this session has imported (collected):
    those tests will ask too. A family a run does not collect (e.g. the Adam ones when only the
    SGD / Lion files run) costs its processes nothing."""
    return [name for name, spec in FAMILIES.items()
            if name == family or spec.split(":")[0] in sys.modules]


def digests(family: str) -> dict[str, str]:
    """{isa: digest} of `family`; the processes run once per test session (again only for a
    family the first run did not expect)."""
    global _results
    if _results is None or family not in _results[ISAS[0]]:
        seed = str(int(torch.randint(0, 2**31, ()).item()))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
        # four processes on a (loaded, 2-core) CI machine: an OpenMP thread waiting at a barrier
        # sleeps instead of spinning on a core the other processes need. The thread count, and
        # so each kernel's parallel split, is the caller's as before.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        names = _session_families(family)
        procs = {isa: subprocess.Popen([sys.executable, "-m", "tests.isa_builds", seed, *names],
                                       cwd=_ROOT, env=dict(env, MPFUSED_CPU_ISA=isa), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for isa in ISAS}
        out = {}
        for isa, proc in procs.items():
            stdout, stderr = proc.communicate()
            assert proc.returncode == 0, (isa, stderr[-4000:])
            out[isa] = json.loads(stdout.strip().splitlines()[-1])
        _results = {isa: {**(_results or {}).get(isa, {}), **out[isa]} for isa in ISAS}
    return {isa: _results[isa][family] for isa in ISAS}


def _main(seed: int, families: list[str]) -> None:
    out = {}
    for name in families:
        module, fn = FAMILIES[name].split(":")
        out[name] = getattr(importlib.import_module(module), fn)(seed)
    print(json.dumps(out))


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2:])
