"""The named cases of the block-wise SGD / Lion ops (tests/sgd_lion_quant_harness.py), each run
for both code widths (sgd8bit_step_ / lion8bit_step_, sgd4bit_step_ / lion4bit_step_).

A case is a dict of the op's own keywords plus an `id` (as tests/test_sgd_lion_kernels.py's):
`kind` (sgd | lion), `dtypes` (one dtype, or one per tensor), `master_mode`, and the harness's
options: `lr_tensor` (True: a tensor lr, the float lr then bogus), `scale` (the grads' loss
scale: grad_scale + found_inf) and `clip` (max_grad_norm as a multiple of the unscaled grad norm)
as the 32-bit harness's, or `fixed` (unscale by 2 and clip norm 4 to 1: mult = 1/8); `sizes`
(1-d tensors; default shapes_for(block): odd sizes, empties, a 2-d tensor, several blocks with a
partial last one), `big` (the widths that add a 70,001-element multi-chunk tensor natively),
`steps` (per-tensor step counts, cycled; default random 0 | 1 | 9), `nsteps` (steps compared, each
from the reference's copy of the same state), `fresh` (new grads before the first step too),
`tiny` (8-bit: zero states with tiny negative grads for the sign rule). `block_size` None: the
width's default block (256 | 128). SGD always has momentum (> 0: the buffer is its only state).

STEP_CASES: three steps each with fresh grads, the 32-bit harness's scaling (every dtype, master
mode, block size, loss scale, clipping, device lr, stochastic-rounding streams); GRID_CASES: one
step from a mid-training state, fixed scaling, every dtype x master mode x option set.
"""
import torch

from tests import test_sgd_lion_kernels as SL
from tests.sgd_lion_quant_harness import (BF16, F16, F32, FP32_MASTER, HYPER, NONE, REMAINDER,
                                          REMAINDER8, STOCHASTIC, make_state, op_name)

MIXED = SL.MIXED
F32_BF16 = (F32, BF16, BF16, F32, BF16, F32)  # remainder8: fp16 params are refused
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCK = {8: 256, 4: 128}
PARAM_IDS = dict(param_ids=[7, 3, 0, 12, 5, 1], elem_offsets=[0, 4096, 64, 0, 1 << 40, 9])


def shapes_for(block):
    """Odd sizes, empties, a 2-d tensor, and several blocks with a partial last one."""
    return [(1,), (0,), (7,), (2 * block + block // 2 + 3,), (2, 0), (5, 13)]


def sgd(id, dtypes, master_mode, **kw):
    return dict(id=f"sgd-{id}", kind="sgd", dtypes=dtypes, master_mode=master_mode, **kw)


def lion(id, dtypes, master_mode, **kw):
    return dict(id=f"lion-{id}", kind="lion", dtypes=dtypes, master_mode=master_mode, **kw)


STEP_CASES = [
    sgd("f32", F32, NONE),
    sgd("f32-damp-l2-b256", F32, NONE, dampening=0.1, weight_decay=0.1, block_size=256),
    sgd("f32-nesterov-max-lrT-scale-clip", F32, NONE, nesterov=True, maximize=True,
        lr_tensor=True, scale=1024.0, clip=0.5),
    sgd("f32-mom05-l2-max-scale64k-b4096", F32, NONE, momentum=0.5, weight_decay=0.1,
        maximize=True, scale=65536.0, block_size=4096),
    sgd("f16-l2-b128", F16, NONE, weight_decay=0.1, block_size=128),
    sgd("f16-master-nesterov-l2-lrT-scale-clip", F16, FP32_MASTER, nesterov=True,
        weight_decay=0.1, lr_tensor=True, scale=1024.0, clip=0.5),
    sgd("bf16-damp-b512", BF16, NONE, dampening=0.5, block_size=512),
    sgd("bf16-master-l2-clip-inactive", BF16, FP32_MASTER, weight_decay=0.1, scale=8.0, clip=4.0),
    sgd("bf16-remainder-nesterov-l2-scale-clip", BF16, REMAINDER, nesterov=True,
        weight_decay=0.1, scale=1024.0, clip=0.5),
    sgd("bf16-remainder-max-lrT-b1024", BF16, REMAINDER, maximize=True, lr_tensor=True,
        block_size=1024),
    sgd("bf16-sr-l2-scale-clip", BF16, STOCHASTIC, weight_decay=0.1, scale=1024.0, clip=0.5),
    sgd("bf16-sr-lrT-seed-b2048", BF16, STOCHASTIC, lr_tensor=True, seed=-(2**62) - 12345,
        block_size=2048),
    sgd("mixed-master-nesterov-l2-scale-clip", MIXED, FP32_MASTER, nesterov=True,
        weight_decay=0.1, scale=1024.0, clip=0.5),
    sgd("mixed-sr-damp-max-lrT-ids", MIXED, STOCHASTIC, dampening=0.1, maximize=True,
        lr_tensor=True, **PARAM_IDS),
    sgd("bf16-remainder8-nesterov-l2-scale-clip", BF16, REMAINDER8, nesterov=True,
        weight_decay=0.1, scale=1024.0, clip=0.5),
    sgd("f32bf16-remainder8-damp-max-lrT-b1024", F32_BF16, REMAINDER8, dampening=0.1,
        maximize=True, lr_tensor=True, block_size=1024),
    lion("f32", F32, NONE),
    lion("f32-wd-max-lrT-scale-clip-b256", F32, NONE, weight_decay=0.1, maximize=True,
         lr_tensor=True, scale=1024.0, clip=0.5, block_size=256),
    lion("f32-betas-wd1-scale64k-b4096", F32, NONE, beta1=0.95, beta2=0.98, weight_decay=1.0,
         scale=65536.0, block_size=4096),
    lion("f16-wd-b128", F16, NONE, weight_decay=0.1, block_size=128),
    lion("f16-master-wd-lrT-scale-clip", F16, FP32_MASTER, weight_decay=0.1, lr_tensor=True,
         scale=1024.0, clip=0.5),
    lion("bf16-max-b512", BF16, NONE, maximize=True, block_size=512),
    lion("bf16-master-wd-clip-inactive", BF16, FP32_MASTER, weight_decay=0.1, scale=8.0,
         clip=4.0),
    lion("bf16-remainder-wd-scale-clip", BF16, REMAINDER, weight_decay=0.1, scale=1024.0,
         clip=0.5),
    lion("bf16-remainder-max-lrT-b1024", BF16, REMAINDER, maximize=True, lr_tensor=True,
         block_size=1024),
    lion("bf16-sr-wd-scale-clip", BF16, STOCHASTIC, weight_decay=0.1, scale=1024.0, clip=0.5),
    lion("bf16-sr-lrT-seed-b2048", BF16, STOCHASTIC, lr_tensor=True, seed=0x5DEECE66D,
         block_size=2048),
    lion("mixed-master-wd-scale-clip", MIXED, FP32_MASTER, weight_decay=0.1, scale=1024.0,
         clip=0.5),
    lion("mixed-sr-max-lrT-ids", MIXED, STOCHASTIC, maximize=True, lr_tensor=True, **PARAM_IDS),
    lion("bf16-remainder8-wd-scale-clip-b128", BF16, REMAINDER8, weight_decay=0.1, scale=1024.0,
         clip=0.5, block_size=128),
    lion("f32bf16-remainder8-max-lrT-b2048", F32_BF16, REMAINDER8, maximize=True,
         lr_tensor=True, block_size=2048),
]

# every master mode: none (fp32, fp16, bf16 params), fp32 master, remainder, SR, remainder8
DTYPE_MODES = {"f32": (F32, NONE), "f16-master": (F16, FP32_MASTER), "f16": (F16, NONE),
               "bf16-master": (BF16, FP32_MASTER), "bf16-remainder": (BF16, REMAINDER),
               "bf16-sr": (BF16, STOCHASTIC), "bf16": (BF16, NONE),
               "bf16-remainder8": (BF16, REMAINDER8)}
# option sets (lr as bitsandbytes' tests: 0.05 SGD, 1e-3 Lion); the first of each kind also
# gets the 70,001-element tensor at 4 bits (its float64 reference costs seconds)
OPTION_SETS = {
    "sgd": {"plain": dict(lr=0.05, big=(8, 4)),
            "nesterov-l2-lrT": dict(lr=0.05, nesterov=True, weight_decay=1e-2, lr_tensor=True),
            "damp-l2-max": dict(lr=0.05, dampening=0.3, weight_decay=1e-2, maximize=True)},
    "lion": {"plain": dict(lr=1e-3, big=(8, 4)),
             "betas-wd-max-lrT": dict(lr=1e-3, beta1=0.95, beta2=0.98, weight_decay=0.1,
                                      maximize=True, lr_tensor=True)},
}
GRID = dict(sizes=(701, 256, 128, 1, 0, 257, 300), steps=(3, 0, 9), block_size=None, fixed=True,
            nsteps=1, fresh=False, tiny=True)
GRID_CASES = [
    dict(id=f"{kind}-{oname}-{dname}", kind=kind, dtypes=dt, master_mode=mode,
         **{**GRID, "big": (8,), **opts})
    for kind, sets in OPTION_SETS.items() for oname, opts in sets.items()
    for dname, (dt, mode) in DTYPE_MODES.items()]
CASES = STEP_CASES + GRID_CASES
HARNESS_KEYS = ("id", "kind", "dtypes", "master_mode", "lr_tensor", "scale", "clip", "fixed",
                "sizes", "big", "steps", "nsteps", "fresh", "tiny")


def case_state(case, bits, device, backend="native"):
    """(op, state, op keywords, run options) of a named case at `bits`."""
    op = op_name(case["kind"], bits)
    block = case.get("block_size", HYPER[case["kind"]]["block_size"]) or DEFAULT_BLOCK[bits]
    if "sizes" in case:
        big = backend == "native" and bits in case.get("big", ())
        shapes = [(n,) for n in case["sizes"]] + ([(70001,)] if big else [])
    else:
        shapes = shapes_for(block)
    steps = case.get("steps")
    steps = None if steps is None else [steps[i % len(steps)] for i in range(len(shapes))]
    dtypes = case["dtypes"]
    s = make_state(shapes, list(dtypes) if isinstance(dtypes, tuple) else dtypes,
                   case["master_mode"], device, block, steps, op=op, tiny=case.get("tiny", False))
    kw = {k: v for k, v in case.items() if k not in HARNESS_KEYS}
    kw.update(block_size=block, master_mode=case["master_mode"])
    if case.get("lr_tensor"):
        # lr is ignored when lr_tensor is given (the optimizer passes 0.0): a bogus value here
        kw.update(lr=123.0, lr_tensor=torch.tensor(2e-2, device=device))
    run = dict(nsteps=case.get("nsteps", 3), scale=case.get("scale"), clip=case.get("clip"),
               fixed=case.get("fixed", False), fresh=case.get("fresh", True))
    return op, s, kw, run
