"""Master-mode codes and the mode a kernel applies per param dtype: the Python statement of
csrc/include/mpfused/adam_math.h's MasterMode / effective mode (dispatch_master_mode), for the
operand checks of the fake kernels and Triton launchers (mpfused/operand_checks.py), the Triton
launch loops (triton_kernels/_elementwise.py), the reference (mpfused/reference/adam.py) and the
optimizers' names for them (optim/engine.py)."""
from __future__ import annotations

import torch

# adam_math.h's MasterMode: the int master_mode every step op takes.
NO_MASTER, FP32_MASTER, REMAINDER, STOCHASTIC, REMAINDER8 = 0, 1, 2, 3, 4
# The masters operand of the modes that keep one (adam_math.h's MasterStore).
MASTER_DTYPE = {FP32_MASTER: torch.float32, REMAINDER: torch.int16, REMAINDER8: torch.int8}


def kernel_mode(dtype: torch.dtype, master_mode: int) -> int:
    """adam_math.h's effective master mode: fp32 params are their own master; fp16 params have
    an fp32 master or none; bf16 params take every mode."""
    if dtype == torch.float32:
        return NO_MASTER
    if dtype == torch.float16:
        return FP32_MASTER if master_mode == FP32_MASTER else NO_MASTER
    return master_mode
