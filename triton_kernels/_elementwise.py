"""Host side shared by the Triton elementwise optimizer steps (Adam, SGD, Lion): argument checks,
the master mode a tensor gets, staging of layouts the kernels cannot update in place, the
per-tensor launch loop (one launch per non-empty tensor: pointer tables are not portable to the
interpreter) and the device-side step-counter advance.

Sync-free: the step counters, lr_tensor, grad_scale, found_inf and norm_sq are only handed to
the kernels, which read them on device. A kernel returns at once when found_inf > 0, and the step
counters advance by (found_inf <= 0) with one foreach op, so a skipped step changes nothing.

Layouts: a tensor whose operands are all dense with the param's strides is updated in place in
memory order (except stochastic rounding, which needs the logical order: contiguous operands);
any other is staged through contiguous copies, written back after the launch.
"""
from __future__ import annotations

import torch

from mpfused.master_modes import MASTER_DTYPE, REMAINDER8, STOCHASTIC, kernel_mode
from mpfused.triton_kernels._bits import DTYPE_CODE, num_warps_for

BLOCK = 2048
M64 = (1 << 64) - 1


def check_master_mode(params, masters, master_mode) -> None:
    """The bindings' check_masters: a known mode, remainder8 only for bf16 (or fp32) params, and
    masters of the mode's dtype (MASTER_DTYPE)."""
    if int(master_mode) not in range(5):
        raise RuntimeError("mpfused: master_mode must be 0 (none), 1 (fp32), 2 (remainder), "
                           f"3 (stochastic) or 4 (remainder8), got {master_mode}")
    want = MASTER_DTYPE.get(int(master_mode))
    for i, p in enumerate(params):
        if int(master_mode) == REMAINDER8 and p.dtype == torch.float16:
            raise RuntimeError(f"mpfused: master_mode 4 (remainder8) needs bfloat16 (or float32) "
                               f"params: params[{i}] is float16, which is not the top half of an "
                               "fp32 word")
        if want is not None and i < len(masters) and masters[i].dtype != want:
            raise RuntimeError(f"mpfused: masters[{i}] must be {want}, got {masters[i].dtype}")


def check_steps(steps, dev) -> None:
    """The bindings' check_steps_and_scalars rule for the step counters: each a 1-element float32
    tensor on the params' device (the kernels read it as fp32; advance_steps adds to it in place,
    so another dtype would be refused only after the update, or not at all)."""
    for i, t in enumerate(steps):
        if t.numel() != 1 or t.dtype != torch.float32 or t.device != dev:
            raise RuntimeError(f"mpfused: steps[{i}] must be a 1-element float32 tensor on {dev}, "
                               f"got {list(t.shape)} {t.dtype} on {t.device}")


def check_amp_scalars(grad_scale, found_inf, norm_sq) -> None:
    """The bindings' check_scalar_f32 rule for the optional AMP scalars: each a 1-element float32
    tensor (the kernels read it as fp32; their devices are checked with the other operands)."""
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("norm_sq", norm_sq)):
        if t is not None and (t.numel() != 1 or t.dtype != torch.float32):
            raise RuntimeError(f"mpfused: {name} must be a 1-element float32 tensor, got "
                               f"{list(t.shape)} {t.dtype}")


def check_operands(op, params, grads, states, masters, steps, master_mode, lr_tensor, grad_scale,
                   found_inf, norm_sq):
    """The native bindings' checks. `states`: (name, tensors) pairs of fp32 per-param state, each
    with one tensor per param (an optional state the caller leaves out when absent)."""
    n = len(params)
    for name, lst in [("grads", grads)] + list(states) + [("steps", steps)]:
        if len(lst) != n:
            raise RuntimeError(f"mpfused: {op}: {name} has {len(lst)} tensors, params {n}")
    dev = params[0].device
    for name, t in [("lr_tensor", lr_tensor), ("grad_scale", grad_scale), ("found_inf", found_inf),
                    ("norm_sq", norm_sq)]:
        if t is not None and (t.device != dev or t.numel() != 1):
            raise RuntimeError(f"mpfused: {name} must be a 1-element tensor on {dev} (the "
                               f"params' device), got {tuple(t.shape)} on {t.device}")
    check_steps(steps, dev)
    check_amp_scalars(grad_scale, found_inf, norm_sq)
    check_master_mode(params, masters, master_mode)
    for i, p in enumerate(params):
        if p.dtype not in DTYPE_CODE:
            raise RuntimeError(f"mpfused: params[{i}] must be float32, float16 or bfloat16, got {p.dtype}")
        if grads[i].dtype != p.dtype:
            raise RuntimeError(f"mpfused: grads[{i}] must have its param's dtype {p.dtype}, got "
                               f"{grads[i].dtype}")
        ops = [("grads", grads[i])] + [(name, lst[i]) for name, lst in states]
        mode = kernel_mode(p.dtype, int(master_mode))
        if mode in MASTER_DTYPE:
            if len(masters) != n:
                raise RuntimeError(f"mpfused: {op}: one master per param is required")
            ops.append(("masters", masters[i]))
        for name, t in [("params", p)] + ops:
            if t.layout != torch.strided:
                raise RuntimeError(f"mpfused: {name}[{i}] is sparse; mpfused optimizers support "
                                   "dense tensors only")
            if name == "params":
                continue
            if name not in ("grads", "masters") and t.dtype != torch.float32:
                raise RuntimeError(f"mpfused: {name}[{i}] must be torch.float32, got {t.dtype}")
            if t.numel() != p.numel() or t.device != p.device:
                raise RuntimeError(f"mpfused: {name}[{i}] differs from params[{i}] in size or device")


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill [data_ptr, data_ptr + numel) in some order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def stage(tensors, mutated, logical_order):
    """Kernel operands of one tensor: in place when every operand is dense with the param's
    strides (and, for stochastic rounding, in logical order), else contiguous copies; returns
    (operands, write-backs)."""
    p = tensors[0]
    present = [t for t in tensors if t is not None]
    if logical_order:
        direct = all(t.is_contiguous() for t in present)
    else:
        direct = all(dense(t) and t.stride() == p.stride() for t in present)
    if direct:
        return list(tensors), []
    out, back = [], []
    for t, mut in zip(tensors, mutated):
        if t is None:
            out.append(None)
            continue
        c = t.contiguous()
        out.append(c)
        if mut and c is not t:
            back.append((t, c))
    return out, back


def for_each_tensor(params, grads, states, masters, master_mode, launch):
    """Call launch(i, mode, [param, grad, *states, master]) for each non-empty param, with the
    operands staged (see `stage`; None for an absent state or master) and written back after it.
    `states`: per-param state lists, each None (absent) or one mutable tensor per param."""
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        mode = kernel_mode(p.dtype, int(master_mode))
        master = masters[i] if mode in MASTER_DTYPE else None
        tensors = [p, grads[i]] + [s[i] if s is not None else None for s in states] + [master]
        mutated = [True, False] + [True] * (len(states) + 1)
        ops, back = stage(tensors, mutated, logical_order=mode == STOCHASTIC)
        launch(i, mode, ops)
        for orig, staged in back:
            orig.copy_(staged)  # a skipped step wrote nothing: the copy-back restores the same


def scalar_operands(dummy, lr_tensor, grad_scale, found_inf, norm_sq, max_grad_norm):
    """The kernels' (lr, grad_scale, found_inf, norm_sq) pointers, `dummy` for absent ones (never
    dereferenced), and their HAS_* constexprs. Clipping is on only with a norm and a positive
    max_grad_norm."""
    has_norm = norm_sq is not None and max_grad_norm > 0
    present = (lr_tensor, grad_scale, found_inf, norm_sq if has_norm else None)
    ptrs = [t if t is not None else dummy for t in present]
    flags = dict(HAS_LR=lr_tensor is not None, HAS_SCALE=grad_scale is not None,
                 HAS_FOUND=found_inf is not None, HAS_NORM=has_norm)
    return ptrs, flags


def launch_options(block: int = BLOCK) -> dict:
    """Block, warps, and no FMA contraction: interpreted and compiled runs round alike."""
    return dict(BLOCK=block, num_warps=num_warps_for(block), enable_fp_fusion=False)


def advance_steps(steps, found_inf):
    """Step counters advance only on a taken step, decided on device (no host sync)."""
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(list(steps), 1)
    else:
        taken = (found_inf.reshape(()) <= 0).to(steps[0].dtype)
        torch._foreach_add_(list(steps), taken)
