"""The fp32 value of a param and its store back, per master mode (csrc/include/mpfused/
adam_math.h::load_weight / store_weight): an fp32 master, the bf16 remainder (int16), the
one-byte correction (int8, a 24-bit master), stochastic rounding or none. Shared by every Triton optimizer kernel, so all of them keep a param the same way."""
import triton
import triton.language as tl

from mpfused.triton_kernels._bits import load_f32, store_f32


@triton.jit
def load_weight(p_ptr, master_ptr, offs, mask, DT: tl.constexpr, MODE: tl.constexpr):
    """adam_math.h::load_weight: the fp32 value of the param per master mode."""
    if MODE == 1:
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    elif MODE == 2:
        # remainder_join: hi16 = p_bits - (rem < 0), lo16 = rem
        pb = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        rem = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.where(rem < 0, (pb - 1) & 0xFFFF, pb)
        w = ((hi << 16) | (rem & 0xFFFF)).to(tl.float32, bitcast=True)
    elif MODE == 4:
        # remainder8_join: hi16 = p_bits - (rem8 < 0), bits 8..15 = rem8, bits 0..7 zero
        pb = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        rem = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.where(rem < 0, (pb - 1) & 0xFFFF, pb)
        w = ((hi << 16) | ((rem & 0xFF) << 8)).to(tl.float32, bitcast=True)
    else:
        w = load_f32(p_ptr, offs, mask, DT)
    return w


@triton.jit
def store_weight(w, p_ptr, master_ptr, offs, mask, seed, ti, stream, DT: tl.constexpr,
                 MODE: tl.constexpr):
    """adam_math.h::store_weight: the param (and its master) from the updated fp32 value; `offs`
    is the logical element index, `stream` the tensor's sr_stream (an int64 bit pattern)."""
    if MODE == 1:
        tl.store(master_ptr + offs, w, mask=mask)
        store_f32(p_ptr, offs, w, mask, DT)
    elif MODE == 2:
        # remainder_split: lo16 -> remainder, hi16 rounded to nearest (ties away from zero);
        # NaN -> the canonical 0x7FC00000 (GPU arithmetic makes 0x7FFFFFFF, which would round
        # to a -0.0 param)
        u = w.to(tl.uint32, bitcast=True)
        u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, u)
        lo = u & 0xFFFF
        phi = ((u >> 16) + (lo >> 15)) & 0xFFFF
        tl.store(p_ptr + offs, phi.to(tl.int32).to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, lo.to(tl.int32).to(tl.int16), mask=mask)
    elif MODE == 4:
        # remainder8_split: round to 24 bits (nearest, ties to even; NaN -> 0x7FC00000), bits
        # 8..15 -> the int8 correction, hi16 rounded up when bit 15 is set
        u = w.to(tl.uint32, bitcast=True)
        r = (u + 0x7F + ((u >> 8) & 1)) & 0xFFFFFF00
        u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, r)
        lo = (u >> 8) & 0xFF
        phi = ((u >> 16) + (lo >> 7)) & 0xFFFF
        tl.store(p_ptr + offs, phi.to(tl.int32).to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, lo.to(tl.int32).to(tl.int8), mask=mask)
    elif MODE == 3:
        # bf16_bits_stochastic(w, random16(step_seed(seed, t), stream, index))
        sseed = seed.to(tl.uint64) ^ (ti.to(tl.uint64) * 0xD1B54A32D192ED03)
        # random16(sseed, stream, index): splitmix64 finalizer, uint64 wrap-around
        z = sseed + stream.to(tl.uint64) + offs.to(tl.uint64) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        r16 = (z >> 48).to(tl.uint32)
        u = w.to(tl.uint32, bitcast=True)
        bits = (u + r16) >> 16
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, bits)
        tl.store(p_ptr + offs, bits.to(tl.int32).to(tl.int16), mask=mask)
    else:
        store_f32(p_ptr, offs, w, mask, DT)
