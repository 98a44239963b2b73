"""Tolerances by dtype, stated once. Kernels compute in fp32 and are compared with the float64
reference; a 16-bit result may differ by one unit in the last place (double rounding)."""
import torch

# (rtol, atol) for a single application of an op, per storage dtype.
OP_TOL = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (1e-3, 1e-5),    # 1 fp16 ulp is 2^-10 relative
    torch.bfloat16: (8e-3, 1e-5),   # 1 bf16 ulp is 2^-7 relative
}
# A remainder8 master (bf16 param + int8 correction: a 24-bit float, 16 significant bits) against
# the float64 reference: the kernel's fp32 result may round to the neighbouring 24-bit value (one
# ulp, at most 2^-15 relative). 2^-14 leaves a 2x margin and still fails a bf16-only store (2^-8).
REMAINDER8_TOL = {"rtol": 2.0**-14, "atol": 1e-6}
# fp32 optimizer trajectories over tens of steps: rounding accumulates differently in two fp32
# implementations (torch's own optimizer tests compare implementations with atol 1e-5).
TRAJ_TOL = {"rtol": 1e-5, "atol": 1e-5}


def assert_close(actual, expected, dtype=None, **kw):
    dtype = dtype or expected.dtype
    rtol, atol = OP_TOL.get(dtype, OP_TOL[torch.float32])
    kw.setdefault("rtol", rtol)
    kw.setdefault("atol", atol)
    # NaN never passes: equal_nan stays False.
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=False, **kw)

# Precision against a float64 run (tests/test_precision.py): mean |p - p_float64| of an fp32
# Adam(W) after 10 steps at lr=1, as a multiple of torch.optim.AdamW(foreach=False)'s own fp32
# error on the same run. The kernels derive the same constants in double and round them once, as
# torch does, but place a few roundings differently (sqrt(v) times 1/sqrt(1-beta2^t) instead of a
# division; w - fp32(lr*wd)*w instead of w*fp32(1-lr*wd)): the same precision class, measured
# 0.2-1.2x. 2x leaves room for that and still fails constants rounded twice (24-8300x).
PRECISION_VS_TORCH = 2.0

# Lion steps by sign(c), c = beta1*m + (1-beta1)*g: where c is within the fp32 kernel's rounding
# of 0, the kernel and the float64 reference may take opposite signs (w then differs by 2*lr, a
# tie, not an error). Such elements are left out of the param comparison: those with
# |c| <= LION_SIGN_RTOL * (|beta1*m| + |(1-beta1)*g|). The kernel rounds c about 4 times (each
# <= 2^-24 of those magnitudes) plus fp32 beta1 and 1-beta1: < 5e-7, so 1e-5 keeps a 20x margin
# and drops ~1e-5 of random elements.
LION_SIGN_RTOL = 1e-5

# A block's new absmax (8-/4-bit state) against the float64 reference: the moment is a sum of two
# terms (beta*decoded state and (1-beta)*g or g^2) that can cancel, so its fp32 rounding error is
# relative to the terms, not to the result. A few fp32 roundings of the larger term, 2^-24 each:
# 1e-6 of (old absmax + the gradient term) is ~16 of them, and fails any real difference.
ABSMAX_TOL_OF_TERMS = 1e-6

# Decoded 8-bit states of two implementations compared per block (test_sgd_lion_8bit_bnb): the
# values are float32 products map[code] * absmax, each rounded to half an ulp of a value up to
# absmax, so their difference over the block's absmax carries up to 2**-23 on top of the map's
# widest gap (measured 1.4e-7 over it on one draw; a 1e-5 relative slack, 1.4e-7, was too tight).
DECODED_GAP_ROUNDING = 2.0**-22

# Gradient release with clip='previous' under FSDP2 (2 gloo ranks) against the single-process
# release on the full model (tests/test_release_fsdp.py), fp32, 10 steps: the per-param sums of
# squares are the shards' sums added (a different order of summation than one pass over the
# full grad), and the grads themselves are the reduce-scatter's average of the ranks' grads
# instead of autograd's grad of the averaged loss: fp32 rounding in another order, carried
# through the clip coefficients and the optimizer's trajectory (as TRAJ_TOL's reason).
RELEASE_FSDP_CLIP_TOL = {"rtol": 1e-5, "atol": 1e-6}
