"""The opening every Triton optimizer kernel shares (32-bit and block-wise states alike): skip the
step when found_inf > 0, then this program's block of elements and its param and grad in fp32.
Triton inlines @triton.jit helpers, so a kernel compiles to the same code as with these lines
written in it."""
import triton
import triton.language as tl

from mpfused.triton_kernels._bits import load_f32
from mpfused.triton_kernels._master import load_weight


@triton.jit
def step_skipped(found_ptr, HAS_FOUND: tl.constexpr):
    """found_inf > 0: the kernel returns at once and touches nothing (``if step_skipped(...):
    return``; a helper's own return would not end the kernel)."""
    skipped = False
    if HAS_FOUND:
        skipped = tl.load(found_ptr) > 0.0
    return skipped


@triton.jit
def block_offsets(n, BLOCK: tl.constexpr):
    """This program's BLOCK elements: 64-bit offsets and the mask at n."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit indexing
    return offs, offs < n


@triton.jit
def load_param(p_ptr, g_ptr, master_ptr, offs, mask, DT: tl.constexpr, MODE: tl.constexpr):
    """The fp32 weight per master mode (_master.load_weight) and the grad in fp32."""
    return load_weight(p_ptr, master_ptr, offs, mask, DT, MODE), load_f32(g_ptr, offs, mask, DT)


@triton.jit
def load_block(p_ptr, g_ptr, master_ptr, n, DT: tl.constexpr, MODE: tl.constexpr,
               BLOCK: tl.constexpr):
    """block_offsets, then load_param: (offs, mask, w, g)."""
    offs, mask = block_offsets(n, BLOCK)
    w, g = load_param(p_ptr, g_ptr, master_ptr, offs, mask, DT, MODE)
    return offs, mask, w, g
