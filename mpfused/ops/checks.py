"""The fake (meta) kernels' argument checks: list lengths, dtypes and devices, with ``torch._check``,
so a ``torch.compile`` / fake-mode call with a wrong operand fails at trace time with an error
that names the op and the argument ("mpfused: adam_step_: exp_avgs[3] has dtype torch.float16,
expected torch.float32"). The rules are the native bindings' (csrc/bindings/common.h,
quant8_args.h: the kernels' contract, which the bindings keep checking at run time), stated here
once for every family's fake kernel; sizes and values (numels, block sizes, maps) are left to the
kernels, which see real tensors. Cheap: one pass over each list, no tensor is read.
"""
from __future__ import annotations

import torch

from mpfused.master_modes import MASTER_DTYPE, REMAINDER8, kernel_mode

F32 = torch.float32
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def fail(op: str, message: str) -> None:
    torch._check(False, lambda: f"mpfused: {op}: {message}")


def check_list(op: str, name: str, tensors, n: int, dev, dtype=None, *, like=None,
               optional: bool = False) -> None:
    """``tensors`` has n tensors (or none when ``optional``), each on ``dev`` with ``dtype``
    (``like``: the dtype of like[i])."""
    if len(tensors) != n and not (optional and len(tensors) == 0):
        fail(op, f"{name} has {len(tensors)} tensors, expected {n} (one per param"
                 f"{', or none' if optional else ''})")
    for i, t in enumerate(tensors):
        want = like[i].dtype if like is not None else dtype
        if want is not None and t.dtype != want:
            fail(op, f"{name}[{i}] has dtype {t.dtype}, expected {want}")
        if t.device != dev:
            fail(op, f"{name}[{i}] is on {t.device}, expected {dev} (the params' device)")


def check_tensor(op: str, name: str, t, dev, dtype=F32, *, cpu_ok: bool = False) -> None:
    """A tensor operand or optional scalar tensor (None passes): ``dtype`` (None: any) on ``dev``
    (or on the CPU when ``cpu_ok``)."""
    if t is None:
        return
    if dtype is not None and t.dtype != dtype:
        fail(op, f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.device != dev and not (cpu_ok and t.device.type == "cpu"):
        fail(op, f"{name} is on {t.device}, expected {dev} (the params' device"
                 f"{' or the CPU' if cpu_ok else ''})")


def check_step(op: str, params, grads, states, masters, steps, *, master_mode: int, lr_tensor,
               grad_scale, found_inf, norm_sq, param_ids, elem_offsets, codes=(),
               qmaps=()) -> None:
    """The operands of a multi-tensor step op. ``states``: (name, tensors, required) of fp32
    per-param state (an optional one may be empty); ``codes``: (name, tensors) of uint8 block
    codes; ``qmaps``: (name, tensor) fp32 maps."""
    n = len(params)
    if n == 0:
        return
    dev = params[0].device
    for i, p in enumerate(params):
        if p.dtype not in FLOATS:
            fail(op, f"params[{i}] has dtype {p.dtype}, expected float32, float16 or bfloat16")
        if p.device != dev:
            fail(op, f"params[{i}] is on {p.device}, expected {dev} (params[0]'s device)")
    check_list(op, "grads", grads, n, dev, like=params)
    for name, tensors, required in states:
        check_list(op, name, tensors, n, dev, F32, optional=not required)
    for name, tensors in codes:
        check_list(op, name, tensors, n, dev, torch.uint8)
    mode = int(master_mode)
    if mode not in range(5):
        fail(op, f"master_mode must be 0 (none), 1 (fp32), 2 (remainder), 3 (stochastic) or 4 "
                 f"(remainder8), got {mode}")
    needs = any(kernel_mode(p.dtype, mode) in MASTER_DTYPE for p in params)
    if mode == REMAINDER8 and any(p.dtype == torch.float16 for p in params):
        fail(op, "master_mode 4 (remainder8) needs bfloat16 (or float32) params, got float16")
    check_list(op, "masters", masters, n, dev, MASTER_DTYPE.get(mode), optional=not needs)
    check_list(op, "steps", steps, n, dev, F32)
    for name, t in qmaps:
        check_tensor(op, name, t, dev)
    check_tensor(op, "lr_tensor", lr_tensor, dev, None, cpu_ok=True)
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("norm_sq", norm_sq)):
        check_tensor(op, name, t, dev)
    for name, ids in (("param_ids", param_ids), ("elem_offsets", elem_offsets)):
        if len(ids) not in (0, n):
            fail(op, f"{name} has {len(ids)} entries, expected {n} (one per param) or none")


def one_state_fake(op: str, state: str):
    """The fake kernel of a one-state block-wise op, ``(params, grads, <state>, absmaxs, masters,
    steps, qmap, *, block_size, <hyperparameters>, master_mode, ...)`` (sgd8bit_step_,
    lion8bit_step_ and their 4-bit ops): uint8 codes named ``state``, fp32 absmax, an fp32 map."""
    def fake(params, grads, codes, absmaxs, masters, steps, qmap, *, master_mode, lr_tensor,
             grad_scale=None, found_inf=None, norm_sq=None, param_ids=(), elem_offsets=(),
             **hyper):
        check_step(op, params, grads, [("absmaxs", absmaxs, True)], masters, steps,
                   codes=[(state, codes)], qmaps=[("qmap", qmap)], master_mode=master_mode,
                   lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf,
                   norm_sq=norm_sq, param_ids=param_ids, elem_offsets=elem_offsets)
    return fake


def check_amp(op: str, grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor) -> None:
    """The operands of unscale_grads_ / check_grads: grads of a float dtype on one device, the
    scalars float32 on it."""
    dev = grads[0].device if len(grads) else found_inf.device
    for i, g in enumerate(grads):
        if g.dtype not in FLOATS:
            fail(op, f"grads[{i}] has dtype {g.dtype}, expected float32, float16 or bfloat16")
        if g.device != dev:
            fail(op, f"grads[{i}] is on {g.device}, expected {dev} (grads[0]'s device)")
    for name, t in (("found_inf", found_inf), ("inv_scale", inv_scale), ("norm_sq", norm_sq),
                    ("norm_sq_per_tensor", norm_sq_per_tensor)):
        check_tensor(op, name, t, dev)
