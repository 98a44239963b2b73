"""Host side shared by the Triton elementwise optimizer steps (Adam, SGD, Lion): the master mode a
tensor gets, staging of layouts the kernels cannot update in place, the per-tensor launch loop
(one launch per non-empty tensor: pointer tables are not portable to the interpreter) and the
device-side step-counter advance. The argument checks are the ops' (mpfused/operand_checks.py's
check_step with values=True, called by each launcher before anything is written).

Sync-free: the step counters, lr_tensor, grad_scale, found_inf and norm_sq are only handed to
the kernels, which read them on device. A kernel returns at once when found_inf > 0, and the step
counters advance by (found_inf <= 0) with one foreach op, so a skipped step changes nothing.

Layouts: a tensor whose operands are all dense with the param's strides is updated in place in
memory order (except stochastic rounding, which needs the logical order: contiguous operands);
any other is staged through contiguous copies, written back after the launch.
"""
from __future__ import annotations

import torch

from mpfused.master_modes import MASTER_DTYPE, STOCHASTIC, kernel_mode
from mpfused.triton_kernels._bits import num_warps_for

BLOCK = 2048
M64 = (1 << 64) - 1


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
