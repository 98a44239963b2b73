"""Block-wise 8-bit optimizer state in Triton (csrc/include/mpfused/quant8_math.h transcribed),
shared by the 8-bit kernels: one program per quantization block dequantizes its state with the
block's old absmax, the kernel updates it in fp32, and store_quantized writes the new absmax and
codes. Host side: the block sizes, the one-device check and the per-tensor launch loop.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mpfused.triton_kernels._elementwise import kernel_mode

MASTER_NONE, MASTER_FP32, MASTER_REMAINDER, MASTER_STOCHASTIC = 0, 1, 2, 3


@triton.jit
def _encode(thr_ptr, x):
    # quant8_encode: code = #{i : x > thr[i]} by an 8-step binary search.
    c = tl.where(x > tl.load(thr_ptr + 127), 128, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 63), 64, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 31), 32, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 15), 16, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 7), 8, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 3), 4, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 1), 2, 0)
    c += tl.where(x > tl.load(thr_ptr + c), 1, 0)
    return c


@triton.jit
def dequantize(c_ptr, map_ptr, a_ptr, offs, mask):
    """quant8_decode of this program's block: map[code] * the block's (old) absmax."""
    c = tl.load(c_ptr + offs, mask=mask, other=0).to(tl.int32)
    return tl.load(map_ptr + c) * tl.load(a_ptr + tl.program_id(0))


@triton.jit
def store_quantized(x, c_ptr, a_ptr, thr_ptr, offs, mask, zero_code,
                    KEEP_NEGATIVE: tl.constexpr):
    """The new absmax of this program's block of the updated state x, then x's codes
    (KEEP_NEGATIVE: quant8_keep_negative, bitsandbytes' sign rule for a signed state)."""
    # max over the bit patterns of |x| (as the CPU and CUDA kernels): ordered as the floats, and a
    # NaN moment (above inf) gives a NaN absmax; tl.max on floats would skip the NaN
    am = tl.max(tl.where(mask, tl.abs(x), 0.0).to(tl.uint32, bitcast=True), axis=0)
    am = am.to(tl.float32, bitcast=True)
    tl.store(a_ptr + tl.program_id(0), am)
    one = tl.full((), 1.0, tl.float32)
    r = tl.div_rn(one, am)  # quant8_inv_scale: saturates at FLT_MAX
    r = tl.where(r < 3.4028234663852886e38, r, 3.4028234663852886e38)
    q = _encode(thr_ptr, x * r)
    if KEEP_NEGATIVE:
        neg = (x.to(tl.uint32, bitcast=True) >> 31) != 0
        q = tl.where(neg & (q == zero_code), q - 1, q)
    tl.store(c_ptr + offs, q.to(tl.uint8), mask=mask)


# ---- host side --------------------------------------------------------------------------------
def check_block_size(block_size):
    if block_size not in (64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"mpfused: block_size must be a power of two in [64, 4096], got {block_size}")


def check_one_device(dev, lists, singles):
    """Every tensor of `lists` ({name: tensors}) and `singles` ((name, tensor or None) pairs) on
    `dev`."""
    for name, t in [(f"{k}[{i}]", t) for k, ts in lists.items() for i, t in enumerate(ts)] + list(
            singles):
        if t is not None and t.device != dev:
            raise RuntimeError(f"mpfused: {name} is on {t.device}, params[0] on {dev}: one device "
                               "per call")


def for_each_quantized(params, grads, masters, master_mode, launch):
    """launch(i, mode, param, grad, master or None) for each non-empty param, the operands
    contiguous (staged copies are written back after the launch)."""
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        mode = kernel_mode(p.dtype, int(master_mode))
        w = masters[i] if mode in (MASTER_FP32, MASTER_REMAINDER) else None
        # block layout = logical order: every operand contiguous (8-bit state always is)
        ops = [t if t is None or t.is_contiguous() else t.contiguous() for t in (p, grads[i], w)]
        pk, gk, wk = ops
        launch(i, mode, pk, gk, wk)
        if pk is not p:
            p.copy_(pk)  # a skipped step wrote nothing: the copy-back restores the same
        if wk is not w:
            w.copy_(wk)
