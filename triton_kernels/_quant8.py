"""Block-wise 8-bit optimizer state in Triton (csrc/include/mpfused/quant8_math.h transcribed),
shared by the 8-bit kernels: one program per quantization block dequantizes its state with the
block's old absmax, the kernel updates it in fp32, and store_quantized writes the new absmax and
codes. Host side: the per-tensor launch loop and the whole host side of the one-state steps (SGD,
Lion; their argument checks: mpfused/operand_checks.py's one_state_operands).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpfused.master_modes import MASTER_DTYPE, kernel_mode
from mpfused.operand_checks import one_state_operands
from mpfused.quant_maps import thresholds, zero_code as map_zero_code
from mpfused.reference.adam import sr_streams
from mpfused.triton_kernels._bits import DTYPE_CODE, as_kernel_arg, f64_bits, i64_bits
from mpfused.triton_kernels._elementwise import (M64, advance_steps, launch_options,
                                                 scalar_operands)


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
def _encode4(thr_ptr, x):
    # quant4_encode: the same search over a 16-entry map's 16 thresholds (thr[15] = +inf).
    c = tl.where(x > tl.load(thr_ptr + 7), 8, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 3), 4, 0)
    c += tl.where(x > tl.load(thr_ptr + c + 1), 2, 0)
    c += tl.where(x > tl.load(thr_ptr + c), 1, 0)
    return c


@triton.jit
def dequantize(c_ptr, map_ptr, a_ptr, offs, mask, BITS: tl.constexpr = 8):
    """quant8_decode of this program's block: map[code] * the block's (old) absmax. BITS = 4:
    quant4_code_at, element 2k in the high nibble of byte k."""
    if BITS == 8:
        c = tl.load(c_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:
        b = tl.load(c_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
        c = (b >> (((offs & 1) ^ 1) * 4).to(tl.int32)) & 0xF
    return tl.load(map_ptr + c) * tl.load(a_ptr + tl.program_id(0))


@triton.jit
def store_quantized(x, c_ptr, a_ptr, thr_ptr, offs, mask, zero_code,
                    KEEP_NEGATIVE: tl.constexpr, BITS: tl.constexpr = 8):
    """The new absmax of this program's block of the updated state x, then x's codes
    (KEEP_NEGATIVE: quant8_keep_negative, bitsandbytes' sign rule for a signed state). BITS = 4:
    two codes per byte (quant4_pack), an odd tensor's last low nibble 0."""
    # max over the bit patterns of |x| (as the CPU and CUDA kernels): ordered as the floats, and a
    # NaN moment (above inf) gives a NaN absmax; tl.max on floats would skip the NaN
    am = tl.max(tl.where(mask, tl.abs(x), 0.0).to(tl.uint32, bitcast=True), axis=0)
    am = am.to(tl.float32, bitcast=True)
    tl.store(a_ptr + tl.program_id(0), am)
    one = tl.full((), 1.0, tl.float32)
    r = tl.div_rn(one, am)  # quant8_inv_scale: saturates at FLT_MAX
    r = tl.where(r < 3.4028234663852886e38, r, 3.4028234663852886e38)
    if BITS == 8:
        q = _encode(thr_ptr, x * r)
    else:
        q = _encode4(thr_ptr, x * r)
    if KEEP_NEGATIVE:
        neg = (x.to(tl.uint32, bitcast=True) >> 31) != 0
        q = tl.where(neg & (q == zero_code), q - 1, q)
    if BITS == 8:
        tl.store(c_ptr + offs, q.to(tl.uint8), mask=mask)
    else:
        q = tl.where(mask, q, 0)  # the padding nibble of an odd-sized tensor
        hi, lo = tl.split(tl.reshape(q, (q.shape[0] // 2, 2)))
        byte_offs = (offs // 2).to(tl.int64)
        pair_offs = tl.reshape(byte_offs, (q.shape[0] // 2, 2))
        bo, _ = tl.split(pair_offs)
        pair_mask = tl.reshape(mask, (q.shape[0] // 2, 2))
        m0, _ = tl.split(pair_mask)
        tl.store(c_ptr + bo, ((hi << 4) | lo).to(tl.uint8), mask=m0)


# ---- host side --------------------------------------------------------------------------------
def for_each_quantized(params, grads, masters, master_mode, launch):
    """launch(i, mode, param, grad, master or None) for each non-empty param, the operands
    contiguous (staged copies are written back after the launch)."""
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        mode = kernel_mode(p.dtype, int(master_mode))
        w = masters[i] if mode in MASTER_DTYPE else None
        # block layout = logical order: every operand contiguous (8-bit state always is)
        ops = [t if t is None or t.is_contiguous() else t.contiguous() for t in (p, grads[i], w)]
        pk, gk, wk = ops
        launch(i, mode, pk, gk, wk)
        if pk is not p:
            p.copy_(pk)  # a skipped step wrote nothing: the copy-back restores the same
        if wk is not w:
            w.copy_(wk)


def one_state_step(kernel, op, state_name, params, grads, codes, absmaxs, masters, steps, qmap,
                   block_size, master_mode, hyper, lr_tensor, grad_scale, found_inf, norm_sq,
                   max_grad_norm, seed, param_ids, elem_offsets, bits=8, **constexprs):
    """Host side of a one-state 8-bit step (SGD, Lion): checks, one launch per non-empty tensor
    of kernel(param, grad, codes, absmax, master, map, thresholds, step, lr, grad_scale,
    found_inf, norm_sq, n, *hyper, max_grad_norm, zero_code, seed, stream; DT, MODE, HAS_*,
    **constexprs, BLOCK, BITS), then the step counters (on device, by a taken step only).
    `hyper`: the op's float arguments, passed as fp64 bit patterns. ``bits=4``: the 4-bit ops
    (16-entry map, packed codes, no sign rule: zero_code -1)."""
    if not params:
        return
    one_state_operands(op, state_name, params, grads, codes, absmaxs, masters, steps, qmap,
                       block_size=block_size, bits=bits, master_mode=master_mode,
                       lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf,
                       norm_sq=norm_sq, param_ids=param_ids, elem_offsets=elem_offsets,
                       values=True)
    dev = params[0].device
    # the sign rule steps one code below +0 (above its lowest entry: one_state_operands checked)
    thr, zc = thresholds(qmap), map_zero_code(qmap) if bits == 8 else -1
    streams = sr_streams(len(params), param_ids, elem_offsets)
    hyper_bits = [f64_bits(x) for x in tuple(hyper) + (max_grad_norm,)]
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)  # absent pointers (never read)
    scalars, has = scalar_operands(dummy, lr_tensor, grad_scale, found_inf, norm_sq,
                                   max_grad_norm)

    def launch(i, mode, pk, gk, wk):
        kernel[(triton.cdiv(pk.numel(), block_size),)](
            as_kernel_arg(pk), as_kernel_arg(gk), codes[i], absmaxs[i],
            wk if wk is not None else dummy, qmap, thr, steps[i], *scalars, pk.numel(),
            *hyper_bits, zc, int(seed) & M64, i64_bits(streams[i]), DT=DTYPE_CODE[pk.dtype],
            MODE=mode, **has, **constexprs, BITS=bits, **launch_options(block_size))

    for_each_quantized(params, grads, masters, master_mode, launch)
    advance_steps(steps, found_inf)
