"""Storage-type helpers shared by the Triton kernels."""
import struct

import torch
import triton
import triton.language as tl

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def num_warps_for(block: int) -> int:
    """Warps per program of an elementwise block (Liger-Kernel's calculate_settings steps):
    at most 16 elements per thread, so no kernel here spills registers (tests/test_triton_compile)."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


def f64_bits(x: float) -> int:
    """An fp64 kernel argument, exactly: its bit pattern as an int64 (a float argument is fp32
    when compiled but a double under the interpreter). The kernel reads it with f64_from_bits."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def i64_bits(x: int) -> int:
    """A uint64 kernel argument as the int64 with its bits: always an integer type that the
    kernel's .to(tl.uint64) turns back into the same bits (so a value never changes the
    argument's type between i64 and u64, nor recompiles the kernel)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


@triton.jit
def f64_from_bits(b):
    return tl.full((), b, tl.int64).to(tl.float64, bitcast=True)


def as_kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors travel as int16 views; the kernel decodes them with integer ops."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@triton.jit
def load_f32(ptr, offs, mask, DT: tl.constexpr):
    if DT == 2:
        u = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (u << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_f32(ptr, offs, x, mask, DT: tl.constexpr):
    if DT == 2:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(ptr + offs, r.to(tl.int32).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def is_nonfinite(x):
    # platform.h::is_finite_f32 negated: exponent all ones (inf or NaN). A bit test, not
    # `x - x != 0`: compiled with FMA contraction, `x*s - x*s` becomes fma(x, s, -(x*s)), the
    # product's rounding error, which is nonzero for most finite values.
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
