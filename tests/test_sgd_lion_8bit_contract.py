"""The step contract of sgd8bit_step_ / lion8bit_step_ beyond the numbers
(tests/test_sgd_lion_8bit_kernels.py): a skipped step (found_inf > 0) changes no byte, in-kernel
unscale and a tensor lr are the plain step bit for bit, empty lists and tensors, bad input raises
a clear error naming the argument before anything changes, bound lists compute the plain call,
and both ops pass opcheck."""
import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from tests.test_adam_kernels import bits_equal
from tests.test_sgd_lion_8bit_kernels import (BACKENDS, KEYS, OP, clone, hyper_args, make_case,
                                              needs_native, step)

THREE_CASES = [(torch.float32, 0), (torch.bfloat16, 1), (torch.bfloat16, 2)]


# ---- skip, unscale, lr tensor, empties -----------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("dtype,mode", THREE_CASES)
def test_found_inf_skips_everything_bit_for_bit(kind, dtype, mode, backend):
    c = make_case([1000, 0, 5], dtype, mode, 256)
    c["grads"] = [torch.full_like(g, float("inf")) for g in c["grads"]]
    before = clone(c)
    step(kind, c, backend, grad_scale=torch.tensor(65536.0), found_inf=torch.ones(()))
    for k in KEYS:
        for a, b in zip(c[k], before[k]):
            assert bits_equal(a, b), k


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_unscale_and_lr_tensor_are_the_plain_step(kind):
    """grad_scale = 4 (an exact reciprocal) is the step on grads / 4, and lr_tensor the step with
    its float32 value as lr: bit for bit."""
    c = make_case([3000, 17], torch.bfloat16, 1, 256)
    a, b = clone(c), clone(c)
    b["grads"] = [(g.float() / 4).to(g.dtype) for g in b["grads"]]
    lr = torch.tensor(0.0123)
    step(kind, a, grad_scale=torch.tensor(4.0), lr_tensor=lr, lr=99.0)
    step(kind, b, lr=lr.item())
    for k in KEYS[2:] + ("params",):
        for x, y in zip(a[k], b[k]):
            assert bits_equal(x, y), k


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_empty_lists_and_empty_tensors(kind):
    step(kind, {**{k: [] for k in KEYS}, "mode": 0, "block": 256})  # nothing to do
    c = make_case([0, 0], torch.float32, 0, 256)
    step(kind, c)
    assert [s.item() for s in c["steps"]] == [4.0, 4.0]  # counters advance, as torch's


# ---- bad input: a clear error naming the argument, nothing changed -------------------------------
BAD = {  # what breaks the call: the message must name it
    "block_size": lambda c: c.update(block=96),
    "absmaxs": lambda c: c["absmax"].__setitem__(0, c["absmax"][0][:-1]),
    "qmap": lambda c: c.update(qmap=qm.unsigned_map()),  # +0 is its lowest entry
    "master": lambda c: c.update(masters=[]),
    "8-bit codes": lambda c: c["codes"].__setitem__(1, c["codes"][1].float()),
    "steps": lambda c: c["steps"].pop(),
    "grads": lambda c: c["grads"].__setitem__(0, c["grads"][0].half()),
}


@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises_before_anything_changes(kind, bad):
    c = make_case([600, 300], torch.bfloat16, 1, 256)
    tensors = [t for k in KEYS for t in c[k]]
    before = [t.clone() for t in tensors]
    BAD[bad](c)
    with pytest.raises(RuntimeError, match=bad):
        step(kind, c, qmap=c.get("qmap"))
    assert all(bits_equal(a, b) for a, b in zip(tensors, before))


@needs_native
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_sgd8bit_needs_momentum(backend):
    c = make_case([10], torch.float32, 0, 64)
    before = clone(c)
    with pytest.raises(RuntimeError, match="momentum must be > 0"):
        step("sgd", c, backend, momentum=0.0)
    assert all(bits_equal(a, b) for k in KEYS for a, b in zip(c[k], before[k]))


# ---- dispatcher: bound lists, opcheck ------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_bound_lists_compute_the_plain_call(kind):
    c = make_case([500, 3, 0], torch.bfloat16, 2, 128, steps=(0,))
    plain, bound = clone(c), clone(c)
    call = BoundOp(OPS[OP[kind]], [bound["params"], bound["codes"], bound["absmax"],
                                   bound["masters"], bound["steps"]], [4, 1, 9], [0, 8, 0])
    qmap = qm.signed_map()
    rest = dict(block_size=128, **hyper_args(kind), master_mode=2, grad_scale=None,
                found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=5)
    for _ in range(2):
        OPS[OP[kind]](plain["params"], plain["grads"], plain["codes"], plain["absmax"],
                      plain["masters"], plain["steps"], qmap, **rest, param_ids=[4, 1, 9],
                      elem_offsets=[0, 8, 0], backend="native")
        call(bound["grads"], qmap, **rest, backend="native")
    assert call._native is not None  # the C++ lists served the calls
    for k in KEYS:
        assert all(bits_equal(a, b) for a, b in zip(plain[k], bound[k])), k


@pytest.mark.parametrize("kind", ["sgd", "lion"])
@pytest.mark.parametrize("dtype,mode", THREE_CASES)
def test_opcheck(kind, dtype, mode):
    """Schema, fake kernel and aot dispatch of both ops on CPU."""
    c = make_case([300], dtype, mode, 256)
    args = (c["params"], c["grads"], c["codes"], c["absmax"], c["masters"], c["steps"],
            qm.signed_map())
    kwargs = dict(block_size=256, **hyper_args(kind, weight_decay=0.01), master_mode=mode,
                  grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()), norm_sq=None,
                  max_grad_norm=0.0, seed=0)
    torch.library.opcheck(OPS[OP[kind]].overload, args, kwargs)
