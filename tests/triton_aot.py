"""Compile every Triton kernel specialization that mpfused's optimizers and scaler launch, ahead of
time for a CUDA target, on a machine without a GPU (run by tests/test_triton_compile.py). The
optimizers are driven through their classes (AdamW, Adam, AdamW8bit, Adam8bit, SGD, Lion, SGD8bit,
Lion8bit, SGD4bit, Lion4bit), so what compiles is what they launch; the scaler's ops and the
> 2^31-element sizes are called directly.

The rest of the suite runs the Triton kernels under TRITON_INTERPRET=1, which never lowers them:
a kernel the interpreter accepts can still fail to compile, or compile to code that differs from
what the interpreter ran (approximate sqrt/division, FMA contraction). Here the public API runs on
CPU tensors with backend="triton" while Triton believes the active device is a CUDA GPU of the
given compute capability: each launch compiles (source -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin
with Triton's ptxas) with the argument types and specializations (16-byte alignment, 64-bit
integers) that the real call would have, and launches nothing. Kernels are not executed, so the
tensors' values never change.

Usage: python tests/triton_aot.py ARCH OUT.json   (ARCH: 80, 90, ...)
Writes one record per compiled kernel: name, signature, constexprs, PTX, and ptxas' resource
report (registers, spills, stack frame) for the cubin.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="mpfused-triton-aot-")  # really compile
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton <= 3.9's default, made explicit
os.environ.pop("MPFUSED_BACKEND", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import mpfused  # noqa: E402
from mpfused.ops import registry  # noqa: E402


class TargetOnlyDriver:
    """Just enough of a Triton driver to pick a compile target: no device is ever touched."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


COMPILED: dict[str, dict] = {}
_jit_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _jit_run(self, *args, grid=grid, warmup=True, **kwargs)  # warmup: compile, no launch
    constexprs = {p.name: kwargs[p.name] for p in self.params
                  if p.is_constexpr and p.name in kwargs}
    record = {"kernel": self.__name__, "signature": dict(kernel.src.signature),
              "constexprs": constexprs,
              "options": {"enable_fp_fusion": kernel.metadata.enable_fp_fusion,
                          "num_warps": kernel.metadata.num_warps},
              "ptx": kernel.asm["ptx"]}
    key = json.dumps([record["kernel"], record["signature"], record["constexprs"],
                      record["options"]], sort_keys=True)
    COMPILED.setdefault(key, record)
    return kernel


def ptxas_path(arch: int) -> str:
    """The ptxas Triton itself uses for `arch` (the helper's signature varies across versions)."""
    from triton.backends.nvidia import compiler as nv
    try:
        tool = nv.get_ptxas(arch)
    except TypeError:
        tool = nv.get_ptxas()
    return tool.path if hasattr(tool, "path") else tool[0]


def ptxas_report(ptx: str, arch: int, fmad: bool) -> dict:
    """Registers, spill bytes and stack frame of the PTX as ptxas assembles it for Triton."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas_path(arch), "-v", f"--fmad={str(fmad).lower()}",
                              f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", src,
                              "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr

    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    return {"registers": num(r"Used (\d+) registers"),
            "stack_frame": num(r"(\d+) bytes stack frame"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "log": log}


# ---- the calls: every kernel specialization the public API can launch ------------------------
SIZE = 8192  # several programs; a multiple of 16 as most parameter sizes are, so Triton can
# prove 16-byte alignment of every vector of the mask and vectorize; the 2^31 + 5 elements of
# drive_64bit_sizes cover a size that is not


def _params(dtypes):
    ps = [torch.nn.Parameter(torch.randn(SIZE).to(dt)) for dt in dtypes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _drive_optimizer(decoupled_cls, coupled_cls, flags, **fixed):
    """Every (param dtype, master mode) kernel with all options off and all on, and each option
    alone (fp32 params), the coupled-L2 class included. Options: amsgrad, maximize, a tensor lr,
    the scaler's grad_scale + found_inf, fused clipping's norm."""
    def step(cls, dtypes, master, on):
        lr = torch.tensor(1e-3) if "lr_tensor" in on else 1e-3
        kw = dict(fixed, lr=lr, maximize="maximize" in on, weight_decay=0.1,
                  master_weights=master, backend="triton",
                  max_grad_norm=1.0 if "clip" in on else None)
        if "amsgrad" in on:
            kw["amsgrad"] = True
        _step(cls(_params(dtypes), **kw), "scaler" in on)

    for master in ("fp32", "none", "remainder", "remainder8"):
        dtypes = [torch.bfloat16] if master.startswith("remainder") else ALL_DTYPES  # bf16 only
        step(decoupled_cls, dtypes, master, ())
        step(decoupled_cls, dtypes, master, flags)
        step(coupled_cls, dtypes, master, flags)
    for flag in flags:
        step(decoupled_cls, [torch.float32], "fp32", (flag,))
    step(coupled_cls, [torch.float32], "fp32", ())


def drive_adam():
    _drive_optimizer(mpfused.AdamW, mpfused.Adam, ("amsgrad", "maximize", "lr_tensor", "scaler", "clip"))
    # the stochastic-rounding stream seed travels as i32, i64 or u64 by its size
    for seed in (2**40, 2**64 - 5):
        _step(mpfused.AdamW(_params([torch.bfloat16]), master_weights="none", seed=seed,
                            backend="triton"), False)


def drive_adam8bit():
    _drive_optimizer(mpfused.AdamW8bit, mpfused.Adam8bit, ("maximize", "lr_tensor", "scaler", "clip"),
                     min_8bit_size=1)
    for block_size in (64, 128, 512, 1024, 2048, 4096):
        _step(mpfused.AdamW8bit(_params([torch.float32]), block_size=block_size, min_8bit_size=1,
                                backend="triton"), False)


def _drive_class(cls, flags, options=lambda on: {}):
    """An optimizer without a coupled twin (SGD, Lion): every (param dtype, master mode) kernel with
    all options off and all on, each option alone (fp32 params), and the stochastic-rounding seed
    as i64 and u64. options(on): the class's own kwargs for the options in `on`."""
    def step(dtypes, master, on, seed=0):
        lr = torch.tensor(1e-3) if "lr_tensor" in on else 1e-3
        opt = cls(_params(dtypes), lr=lr, weight_decay=0.1, maximize="maximize" in on,
                  master_weights=master, max_grad_norm=1.0 if "clip" in on else None, seed=seed,
                  backend="triton", **options(on))
        _step(opt, "scaler" in on)

    for master in ("fp32", "none", "remainder", "remainder8"):
        dtypes = [torch.bfloat16] if master.startswith("remainder") else ALL_DTYPES  # bf16 only
        step(dtypes, master, ())
        step(dtypes, master, flags)
    for flag in flags:
        step([torch.float32], "fp32", (flag,))
    for seed in (2**40, 2**64 - 5):
        step([torch.bfloat16], "none", (), seed)


def drive_sgd():
    _drive_class(mpfused.SGD, ("momentum", "nesterov", "maximize", "lr_tensor", "scaler", "clip"),
                 lambda on: dict(momentum=0.9 if {"momentum", "nesterov"} & set(on) else 0.0,
                                 nesterov="nesterov" in on))


def drive_lion():
    _drive_class(mpfused.Lion, ("maximize", "lr_tensor", "scaler", "clip"))


def drive_sgd8bit():
    """Through mpfused.SGD8bit as the optimizer launches it (min_8bit_size=1: every param has
    8-bit state), every block size included."""
    _drive_class(mpfused.SGD8bit, ("nesterov", "maximize", "lr_tensor", "scaler", "clip"),
                 lambda on: dict(momentum=0.9, nesterov="nesterov" in on, min_8bit_size=1))
    for block_size in (64, 128, 512, 1024, 2048, 4096):
        _step(mpfused.SGD8bit(_params([torch.float32]), momentum=0.9, block_size=block_size,
                              min_8bit_size=1, backend="triton"), False)


def drive_lion8bit():
    """Through mpfused.Lion8bit, as drive_sgd8bit."""
    _drive_class(mpfused.Lion8bit, ("maximize", "lr_tensor", "scaler", "clip"),
                 lambda on: dict(min_8bit_size=1))
    for block_size in (64, 128, 512, 1024, 2048, 4096):
        _step(mpfused.Lion8bit(_params([torch.float32]), block_size=block_size, min_8bit_size=1,
                               backend="triton"), False)


def drive_scaler():
    # through the public API: unscale_ (the writing pass) + clip_grad_norm_ + update; torch and
    # mpfused refuse unscale_ on fp16 grads
    for dtype in (torch.float32, torch.bfloat16):
        params = _params([dtype])
        scaler = mpfused.GradScaler("cpu", backend="triton")
        scaler.scale(torch.ones(()))  # as scaler.scale(loss): creates the scale
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))
        mpfused.clip_grad_norm_(params, 1.0)
        scaler.update()
    # and every (dtype, writing or read-only, with or without the norm) through the ops
    from mpfused.triton_kernels.amp import check_grads, unscale_grads_
    for dtype in ALL_DTYPES:
        for op in (check_grads, unscale_grads_):
            for norm in (None, torch.zeros(1)):
                op([torch.randn(SIZE).to(dtype)], torch.zeros(1), torch.ones(1), norm_sq=norm)


def drive_64bit_sizes():
    """Tensors of more than 2^31 elements (n becomes an i64 argument): meta tensors, so nothing
    is allocated (the 8-bit maps' thresholds and +0 codes, computed from their values, are
    stubbed, in the launchers and in the signed-map check). No found_inf: the step counters'
    device-side increment by it has no meta kernel."""
    from unittest import mock

    from mpfused import operand_checks
    from mpfused.triton_kernels import _quant8, adam8bit
    from mpfused.triton_kernels.adam import adam_step_
    from mpfused.triton_kernels.amp import unscale_grads_
    from mpfused.triton_kernels.lion import lion_step_
    from mpfused.triton_kernels.sgd import sgd_step_
    n = 2**31 + 5

    def big(dtype=torch.float32, size=n):
        return torch.empty(size, dtype=dtype, device="meta")

    def one():
        return torch.zeros(1, device="meta")

    bf16 = torch.bfloat16
    adam_step_([big(bf16)], [big(bf16)], [big()], [big()], [big()], [big()], [one()], lr=1e-3,
               lr_tensor=one(), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True,
               maximize=False, decoupled=True, master_mode=1, grad_scale=one(), found_inf=None,
               norm_sq=one(), max_grad_norm=1.0)
    unscale_grads_([big(bf16)], one(), one(), norm_sq=one())
    sgd_step_([big(bf16)], [big(bf16)], [big()], [big()], [one()], lr=1e-3, lr_tensor=one(),
              momentum=0.9, dampening=0.0, weight_decay=0.1,
              nesterov=True, maximize=False, master_mode=1, grad_scale=one(), found_inf=None,
              norm_sq=one(), max_grad_norm=1.0)
    lion_step_([big(bf16)], [big(bf16)], [big()], [big()], [one()], lr=1e-4, lr_tensor=one(),
               beta1=0.9, beta2=0.99, weight_decay=0.1,
               maximize=False, master_mode=1, grad_scale=one(), found_inf=None, norm_sq=one(),
               max_grad_norm=1.0)
    blocks = (n + 255) // 256
    with mock.patch.object(adam8bit, "thresholds", lambda qmap: big(size=255)), \
            mock.patch.object(adam8bit, "zero_code", lambda qmap: 127), \
            mock.patch.object(operand_checks, "zero_code", lambda qmap: 127), \
            mock.patch.object(operand_checks, "is_sorted", lambda qmap: True):
        adam8bit.adam8bit_step_([big(bf16)], [big(bf16)], [big(torch.uint8)], [big(torch.uint8)],
                                [big(size=blocks)], [big(size=blocks)], [big()], [one()],
                                big(size=256), big(size=256), block_size=256, lr=1e-3,
                                lr_tensor=one(), beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.1, maximize=False, decoupled=True, master_mode=1,
                                grad_scale=one(), found_inf=None, norm_sq=one(), max_grad_norm=1.0)
    with mock.patch.object(_quant8, "thresholds", lambda qmap: big(size=255)), \
            mock.patch.object(_quant8, "map_zero_code", lambda qmap: 127), \
            mock.patch.object(operand_checks, "zero_code", lambda qmap: 127), \
            mock.patch.object(operand_checks, "is_sorted", lambda qmap: True):
        from mpfused.triton_kernels.lion8bit import lion8bit_step_
        from mpfused.triton_kernels.sgd8bit import sgd8bit_step_
        sgd8bit_step_([big(bf16)], [big(bf16)], [big(torch.uint8)], [big(size=blocks)], [big()],
                      [one()], big(size=256), block_size=256, lr=1e-3, lr_tensor=one(),
                      momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True, maximize=False,
                      master_mode=1,
                      grad_scale=one(), found_inf=None, norm_sq=one(), max_grad_norm=1.0)
        lion8bit_step_([big(bf16)], [big(bf16)], [big(torch.uint8)], [big(size=blocks)], [big()],
                       [one()], big(size=256), block_size=256, lr=1e-4, lr_tensor=one(), beta1=0.9,
                       beta2=0.99, weight_decay=0.1, maximize=False, master_mode=1,
                       grad_scale=one(),
                       found_inf=None, norm_sq=one(), max_grad_norm=1.0)


def drive_onestate4bit():
    """Through mpfused.SGD4bit / Lion4bit (the one-state kernels with BITS = 4): every master
    mode with all options on, and the default block size alone."""
    for cls, flags, options in (
            (mpfused.SGD4bit, ("nesterov", "maximize", "lr_tensor", "scaler", "clip"),
             lambda on: dict(momentum=0.9, nesterov="nesterov" in on, min_8bit_size=1)),
            (mpfused.Lion4bit, ("maximize", "lr_tensor", "scaler", "clip"),
             lambda on: dict(min_8bit_size=1))):
        for master in ("fp32", "none", "remainder", "remainder8"):
            dtypes = [torch.bfloat16] if master.startswith("remainder") else ALL_DTYPES
            opt = cls(_params(dtypes), lr=torch.tensor(1e-3), weight_decay=0.1, maximize=True,
                      master_weights=master, max_grad_norm=1.0, backend="triton",
                      **options(flags))
            _step(opt, True)
        _step(cls(_params([torch.float32]), backend="triton", **options(())), False)


def _step(opt, with_scaler: bool):
    if with_scaler:
        scaler = mpfused.GradScaler("cpu", backend="triton")
        scaler.scale(torch.ones(()))  # as scaler.scale(loss): creates the scale
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def main():
    arch, out = int(sys.argv[1]), sys.argv[2]
    import triton
    report = {"arch": arch, "triton": triton.__version__}
    try:  # Triton internals this script leans on; their absence is not a kernel failure
        ptxas_path(arch)
        driver.set_active(TargetOnlyDriver(arch))
    except Exception as e:
        report["unsupported"] = f"{type(e).__name__}: {e}"
    else:
        JITFunction.run = _compile_only
        usable = registry.triton_usable
        registry.triton_usable = lambda device_type: device_type == "cpu" or usable(device_type)
        errors = []
        for drive in (drive_adam, drive_adam8bit, drive_sgd, drive_lion, drive_sgd8bit,
                      drive_lion8bit, drive_onestate4bit, drive_scaler, drive_64bit_sizes):
            try:
                drive()
            except Exception as e:  # report, and let the other drivers run
                errors.append(f"{drive.__name__}: {type(e).__name__}: {e}")
        records = list(COMPILED.values())
        for r in records:
            r["ptxas"] = ptxas_report(r["ptx"], arch, r["options"]["enable_fp_fusion"])
        report.update(errors=errors, kernels=records)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
