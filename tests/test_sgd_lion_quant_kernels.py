"""sgd8bit_step_ / lion8bit_step_ and sgd4bit_step_ / lion4bit_step_ on every (device, backend)
pair (native CPU/CUDA, Triton: the interpreter on CPU, compiled where a GPU is) against their
float64 references: the one harness of the block-wise SGD / Lion family
(tests/sgd_lion_quant_harness.py: how closely they must agree, and why), its named cases
(tests/sgd_lion_quant_cases.py) for both code widths, every block size, many small tensors.

Exact behaviour (first step, sign rule, encoding, NaN / inf, layouts): test_sgd_lion_quant_exact.py;
the step's contract (skip, unscale, errors, bound lists, opcheck, compile):
test_sgd_lion_quant_contract.py; thread counts, ISA builds and Triton = native bit for bit:
test_sgd_lion_quant_determinism.py (8-bit Triton = native: test_backend_agreement.py);
bitsandbytes' SGD8bit / Lion8bit: test_sgd_lion_8bit_bnb.py."""
import random

import pytest
import torch

from tests.sgd_lion_quant_cases import BLOCK_SIZES, CASES, case_state, shapes_for
from tests.sgd_lion_quant_harness import (BF16, F32, FP32_MASTER, KINDS, NONE, STOCHASTIC,
                                          every_backend, every_width, make_state, op_name,
                                          record_reference, require, run_steps)

recorded = pytest.fixture(record_reference)


@every_backend
@every_width
@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in CASES])
def test_matches_reference(dev, backend, bits, case, recorded):
    op, s, kw, run = case_state(case, bits, dev, backend)
    require(op, dev, backend)
    run_steps(op, s, backend, recorded, **run, **kw)


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_every_block_size(dev, backend, bits, kind, block, recorded):
    op = op_name(kind, bits)
    require(op, dev, backend)
    # fp32 and bf16 + stochastic rounding, blocks of 64..4096 with partial last blocks
    s = make_state(shapes_for(block), [F32, BF16] * 3, STOCHASTIC, dev, block, op=op)
    run_steps(op, s, backend, recorded, nsteps=2, master_mode=STOCHASTIC, block_size=block,
              weight_decay=0.1)
    if backend == "native":  # natively also multi-chunk tensors with partial blocks
        s = make_state([(3 * 4096 + 5,), (1,), (block - 1,), (block + 1,), (32768 + 7,)], F32,
                       NONE, dev, block, steps=[3] * 5, op=op, tiny=True)
        run_steps(op, s, backend, recorded, nsteps=1, fresh=False, block_size=block,
                  weight_decay=1e-2)


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_many_small_tensors(dev, backend, bits, kind, recorded):
    # 400 tensors in one call, some empty: per-tensor steps (SGD's first step included) line up.
    # The 400 are for the native multi-tensor apply, which packs many tensors into each chunk /
    # launch (CPU; CUDA: csrc/cuda/multi_tensor_apply.cuh). Triton launches once per tensor (an
    # interpreted launch each on CPU: 400 cost 5-20 s): tensor i's pointers and step are that
    # launch's own arguments, so 48 tensors of the same sizes check it as hard as 400 (empty, one
    # element, a block -1 / +1, two blocks, each step count, first steps among later ones).
    op = op_name(kind, bits)
    require(op, dev, backend)
    edges = [0, 1, 63, 64, 65, 89]
    count = 400 if backend == "native" else 48
    shapes = [(n,) for n in edges] + [(int(n),) for n in torch.randint(0, 90, (count - 6,))]
    steps = [(0, 1, 5)[i % 3] for i in range(6)] + [random.choice([0, 1, 5]) for _ in shapes[6:]]
    s = make_state(shapes, BF16, FP32_MASTER, dev, 64, steps=steps, op=op, tiny=True)
    run_steps(op, s, backend, recorded, nsteps=1, fresh=False, master_mode=FP32_MASTER)
