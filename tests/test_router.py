"""The router (mpfused/ops/router.py): what torch.ops.mpfused.<op> runs is decided once, at import,
per op and dispatch key, and is what the optimizers and the scaler run; an explicit backend= calls
its implementation directly. CUDA is checked without a GPU: the decision table, and the CUDA key's
kernel reached by redispatch with CPU tensors (spies stand in for the kernels)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpfused
from mpfused import _extension
from mpfused.ops import OPS, router

ROOT = Path(__file__).resolve().parents[1]
NATIVE = _extension.load() is not None

# In a fresh process: opcheck of adam_step_ where a Python kernel serves CPU; then spies on every
# op's reference and Triton function, one unscale_grads_ call through torch.ops on CPU and one
# through the CUDA key (redispatch, CPU tensors), one AdamW step.
PROBE = r"""
import json, warnings
warnings.simplefilter("error")  # the router's overrides must not warn
import torch, mpfused
from mpfused.ops import OPS, router
opcheck = None
if router.REQUEST in ("reference", "triton") and OPS["adam_step_"].route("cpu") != "unavailable":
    from tests.test_adam_kernels import BF16, FP32_MASTER, make_state, op_args  # real kernels
    s = make_state([(7,), (0,), (3, 5)], BF16, FP32_MASTER, True, "cpu")
    torch.library.opcheck(OPS["adam_step_"].overload, *op_args(
        s, master_mode=FP32_MASTER, amsgrad=True, lr_tensor=torch.tensor(1e-3),
        grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()), norm_sq=torch.tensor(4.0),
        max_grad_norm=1.0, seed=3))
    opcheck = OPS["adam_step_"].route("cpu")
ran = []
def spy(op, kind, real):
    def run(*args, **kwargs):
        ran.append(f"{op.name}:{kind}")
        return real(*args, **kwargs)
    return run
for op in OPS.values():  # a spy on the reference stands in for Triton: no import, no GPU
    real = op.reference
    op.reference, op._triton_fn = spy(op, "reference", real), spy(op, "triton", real)
def call(key=None):
    g, f = [torch.tensor([4., 1.])], torch.zeros(())
    try:
        if key is None:
            torch.ops.mpfused.unscale_grads_(g, f, torch.tensor(.5))
        else:
            OPS["unscale_grads_"].overload.redispatch(
                torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)), g, f, torch.tensor(.5))
    except RuntimeError as exc:
        if "must be CUDA tensors" in str(exc):  # the extension's own CUDA kernel (a CUDA build)
            return "native"
        return "refused: " + str(exc)
    assert g[0].tolist() == [2., .5], g
    return ran.pop() if ran else "native"
out = {"request": router.REQUEST, "opcheck": opcheck, "routes": {n: o.routes for n, o in OPS.items()},
       "cpu": call(), "cuda": call("CUDA")}
p = torch.nn.Parameter(torch.ones(3))
p.grad = torch.ones(3)
try:
    mpfused.AdamW([p], lr=0.1).step()
    out["adamw"] = ran or ["native"]
except RuntimeError as exc:
    out["adamw"] = "refused: " + str(exc)
print(json.dumps(out))
"""

ENVS = {
    "unset": {},
    "native": {"MPFUSED_BACKEND": "native"},
    "reference": {"MPFUSED_BACKEND": "reference"},
    "triton": {"MPFUSED_BACKEND": "triton", "TRITON_INTERPRET": "0"},
    "triton-interpret": {"MPFUSED_BACKEND": "triton", "TRITON_INTERPRET": "1"},
    "no-ext": {"MPFUSED_NO_EXT": "1"},
}
_procs: dict = {}


def _subprocess(key: str) -> subprocess.CompletedProcess:
    """Every fresh-process check of this file, started together on first use (the imports are
    most of their cost), then waited for one by one."""
    if not _procs:
        base = {k: v for k, v in os.environ.items()
                if k not in ("MPFUSED_BACKEND", "MPFUSED_NO_EXT")}
        runs = {f"probe-{i}": (PROBE, {"TRITON_INTERPRET": "0", **env}) for i, env in ENVS.items()}
        runs.update({f"gpu-{r}": (GPU_MOCK.replace("RUNS", str(r)), {}) for r in (True, False)})
        runs["bad-env"] = ("import mpfused", {"MPFUSED_BACKEND": "cuda-fast"})
        for k, (code, env) in runs.items():
            _procs[k] = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env={**base, **env})
    proc = _procs[key]
    if not isinstance(proc, subprocess.CompletedProcess):
        out, err = proc.communicate(timeout=300)
        proc = _procs[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return proc


def probe(env_id: str) -> dict:
    r = _subprocess(f"probe-{env_id}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# (env, CPU kernel, CUDA kernel, AdamW's step op on CPU); "native" needs the extension's CPU kernels.
# A CPU-only build registers no native CUDA kernel, so CUDA gets Triton in auto; a CUDA build
# (benchmarks/cuda_torch_build.sh) keeps its own CUDA kernels: no GPU starts here to demote them.
CUDA_BUILD = _extension.with_cuda()
EXPECTED = [
    ("unset", "native", "native" if CUDA_BUILD else "triton", "native"),
    ("native", "native", "native" if CUDA_BUILD else "refused", "native"),
    ("reference", "reference", "reference", "adam_step_:reference"),
    ("triton", "refused", "triton", "refused"),
    ("triton-interpret", "triton", "triton", "adam_step_:triton"),
    ("no-ext", "reference", "triton", "adam_step_:reference"),
]


@pytest.mark.parametrize("env_id,cpu,cuda,adamw", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_dispatcher_runs_what_the_router_registered(env_id, cpu, cuda, adamw):
    if not NATIVE and env_id != "no-ext":
        pytest.skip("needs the native CPU extension")
    out = probe(env_id)
    assert out["request"] == ENVS[env_id].get("MPFUSED_BACKEND", "auto")
    ran = {"cpu": out["cpu"], "cuda": out["cuda"]}
    for key, want in (("cpu", cpu), ("cuda", cuda)):
        if want == "refused":
            assert ran[key].startswith("refused: mpfused: backend"), ran[key]
            assert "MPFUSED_BACKEND" in ran[key], ran[key]
        elif want == "native":
            assert ran[key] == "native"
        else:
            assert ran[key] == f"unscale_grads_:{want}"
        for name, routes in out["routes"].items():  # every op routed alike (no per-op code)
            want_route = "unavailable" if want == "refused" else want
            if CUDA_BUILD and key == "cuda" and want == "native":
                # an op with its own CUDA kernel: pending, completed when CUDA starts
                # (router.finish_cuda); one without: Triton in auto, refused when forced native
                want_route = (None if OPS[name].native_keys.get("cuda") else
                              "triton" if env_id == "unset" else "unavailable")
            if want_route == "triton" and OPS[name].triton_path is None:
                continue
            assert routes[key] == want_route, (name, key, routes)
    # opcheck (schema, fake kernel, aot dispatch) passes on the Python kernels the router registered
    assert out["opcheck"] == (cpu if env_id in ("reference", "triton-interpret") else None)
    if adamw == "refused":
        assert out["adamw"].startswith("refused:"), out["adamw"]
    else:
        assert out["adamw"] == [adamw]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("request_", ["auto", "native", "triton", "reference"])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("interpret", [True, False])
def test_decision_table(device, request_, native, triton, interpret):
    got = router.decide(device, request_, native=native, triton=triton, interpret=interpret)
    triton_here = triton and (device == "cuda" or interpret)
    if request_ == "auto":  # native, else Triton on CUDA only (not the interpreter), else reference
        want = "native" if native else "triton" if triton and device == "cuda" else "reference"
    else:
        can = {"native": native, "triton": triton_here, "reference": True}[request_]
        want = request_ if can else "unavailable"
    assert got == want


GPU_MOCK = r"""
import json, torch
calls = []
torch.cuda._lazy_call = lambda fn, **kw: calls.append(fn)   # CUDA initializes later (below)
real = torch._C._dispatch_has_kernel_for_dispatch_key
torch._C._dispatch_has_kernel_for_dispatch_key = lambda name, key: key == "CUDA" or real(name, key)
import mpfused
from mpfused import _extension
from mpfused.ops import OPS, router
torch._C._dispatch_has_kernel_for_dispatch_key = real
pending = {n: o.routes["cuda"] for n, o in OPS.items()}
_extension.cuda_kernels_run_here = lambda: RUNS
assert len(calls) == 1
calls[0]()   # what CUDA's lazy init runs
print(json.dumps({"pending": pending, "routes": {n: o.routes["cuda"] for n, o in OPS.items()},
                  "dump": torch._C._dispatch_dump("mpfused::adam_step_")}))
"""


@pytest.mark.parametrize("runs", [True, False], ids=["gpu-with-code", "gpu-without-code"])
def test_native_cuda_route_waits_for_cuda_and_the_gpu(runs):
    """With native CUDA kernels the CUDA route is left to CUDA's initialization (import never
    initializes CUDA); then native stays when the build has code for the GPU, else Triton is
    registered over it (not a launch failing with "no kernel image is available")."""
    r = _subprocess(f"gpu-{runs}")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["pending"].values()) == {None}
    assert set(out["routes"].values()) == {"native" if runs else "triton"}
    assert ("CUDA: registered at" in out["dump"] and "router.py" in out["dump"]) is not runs


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mpfused":
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {"AdamW": (mpfused.AdamW, "adam_step_"), "AdamW8bit": (mpfused.AdamW8bit,
              "adam8bit_step_"), "SGD": (mpfused.SGD, "sgd_step_"), "Lion": (mpfused.Lion,
              "lion_step_"), "SGD8bit": (mpfused.SGD8bit, "sgd8bit_step_"),
              "Lion8bit": (mpfused.Lion8bit, "lion8bit_step_")}


def _params(n=2):
    ps = [torch.nn.Parameter(torch.randn(4096)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_and_scaler_call_the_dispatcher_op(name):
    """Each optimizer's step (bound lists included) and the scaler reach torch.ops.mpfused.<op>:
    a dispatch mode sees the op (a direct Python call of an implementation would not show)."""
    cls, op = OPTIMIZERS[name]
    kw = {"min_8bit_size": 0} if "8bit" in name else {}
    opt = cls(_params(), lr=1e-3, **({"momentum": 0.9} if "SGD" in name else {}), **kw)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0)
    for _ in range(2):  # the second step runs on bound lists
        scaler.scale(torch.ones(()))
        with _Record() as seen:
            scaler.step(opt)
            scaler.update()
        assert op in seen.ops and "update_scale_" in seen.ops, seen.ops
        assert {"check_grads", "unscale_grads_"} & set(seen.ops), seen.ops


def test_explicit_backend_calls_the_implementation_directly(monkeypatch):
    ref = OPS["adam_step_"].reference
    calls = []
    monkeypatch.setattr(OPS["adam_step_"], "reference",
                        lambda *a, **k: calls.append(1) or ref(*a, **k))
    opt = mpfused.AdamW(_params(), lr=1e-3, backend="reference")
    with _Record() as seen:
        opt.step()
    assert calls == [1] and "adam_step_" not in seen.ops  # no dispatcher hop
    with _Record() as seen:  # the default: the dispatcher op
        mpfused.AdamW(_params(), lr=1e-3).step()
    assert calls == [1] and seen.ops == ["adam_step_"]


def test_explicit_backend_unavailable_or_unknown_raises(monkeypatch):
    g, f, inv = [torch.ones(2)], torch.zeros(()), torch.ones(())
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton on CPU tensors: interpreter only
    with pytest.raises(RuntimeError, match="'triton' .backend= argument. is not available for op "
                       "unscale_grads_ on cpu.*TRITON_INTERPRET=1"):
        OPS["unscale_grads_"](g, f, inv, backend="triton")
    with pytest.raises(RuntimeError, match="not available for op adam_step_ on cpu"):
        mpfused.AdamW(_params(), lr=1e-3, backend="triton").step()
    with pytest.raises(ValueError, match="backend must be one of"):
        OPS["unscale_grads_"](g, f, inv, backend="cuda-fast")


def test_bad_mpfused_backend_fails_import_naming_the_variable():
    r = _subprocess("bad-env")
    assert r.returncode != 0 and "MPFUSED_BACKEND must be one of" in r.stderr


def test_an_op_defined_after_import_is_routed():
    from mpfused.ops.registry import define_op

    def ref(xs):
        for x in xs:
            x.add_(1)
    op = define_op("router_probe_(Tensor(a!)[] xs) -> ()", reference=ref)
    assert op.routes == {"cpu": "reference", "cuda": "reference"}
    xs = [torch.zeros(3)]
    torch.ops.mpfused.router_probe_(xs)
    assert xs[0].tolist() == [1, 1, 1]
    OPS.pop("router_probe_")
