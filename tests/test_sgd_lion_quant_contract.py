"""The step contract of the block-wise SGD / Lion ops (sgd8bit_step_ / lion8bit_step_,
sgd4bit_step_ / lion4bit_step_) beyond the numbers (tests/test_sgd_lion_quant_kernels.py), on the
one harness (tests/sgd_lion_quant_harness.py): a skipped step (found_inf > 0) changes no byte and
the next one advances every counter, in-kernel unscale and a tensor lr are the plain step bit for
bit, empty lists and tensors, bad input raises a clear error naming the argument before anything
changes, bound lists compute the plain call, opcheck, and torch.compile of the 4-bit optimizers'
step = eager (the 8-bit ones: tests/test_compile_sgd_lion.py)."""
import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from tests import test_sgd_lion_kernels as SL
from tests.conftest import DEVICES
from tests.sgd_lion_quant_harness import (BF16, DEV_BACKENDS, F32, FP32_MASTER, HYPER, KEYS, KINDS,
                                          NONE, REMAINDER, REMAINDER8, STOCHASTIC, clone_state,
                                          every_backend, every_width, make_state, op_args,
                                          op_name, qmap_for, require, step)

bits_equal = SL.bits_equal
with_reference = pytest.mark.parametrize(
    "dev,backend", DEV_BACKENDS + [pytest.param(d, "reference", id=f"{d}-reference")
                                   for d in DEVICES])
THREE_CASES = [(F32, NONE), (BF16, FP32_MASTER), (BF16, REMAINDER)]


def unchanged(a, b):
    return all(bits_equal(x, y) for k in KEYS for x, y in zip(a[k], b[k]))


# ---- skip, unscale, lr tensor, empties -----------------------------------------------------------
@with_reference
@every_width
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,mode", THREE_CASES, ids=["f32", "bf16-master", "bf16-remainder"])
def test_found_inf_skips_everything_bit_for_bit(dev, backend, bits, kind, dtype, mode):
    op = op_name(kind, bits)
    require(op, dev, backend)
    c = make_state([(1000,), (0,), (5,), (301,), (1,)], dtype, mode, dev, 256,
                   steps=[0, 5, 0, 5, 0], op=op)
    c["grads"] = [torch.full_like(g, float("inf")) for g in c["grads"]]
    before = clone_state(c)
    step(op, c, backend, block_size=256, master_mode=mode,
         grad_scale=torch.tensor(65536.0, device=dev), found_inf=torch.ones((), device=dev))
    assert unchanged(c, before)


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [FP32_MASTER, REMAINDER, STOCHASTIC],
                         ids=["master", "remainder", "stochastic"])
def test_skip_then_step(dev, backend, bits, kind, mode):
    op = op_name(kind, bits)
    require(op, dev, backend)
    s = make_state([(7,), (0,), (200,), (4, 5)], [F32, BF16, BF16, BF16], mode, dev, 64,
                   steps=[0, 0, 3, 1], op=op)
    s["grads"][2][3] = float("inf")
    before = clone_state(s)
    step(op, s, backend, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=torch.ones(1, device=dev), norm_sq=torch.tensor(float("inf"), device=dev),
         max_grad_norm=1.0, lr_tensor=torch.tensor(1e-2, device=dev))
    for k in KEYS:
        for x, y in zip(s[k], before[k]):
            assert bits_equal(x, y), k
    # found_inf == 0: the step is taken and every counter advances (empty tensors' included)
    SL.new_grads(s, 8.0)
    step(op, s, backend, master_mode=mode, grad_scale=torch.tensor(8.0, device=dev),
         found_inf=torch.zeros(1, device=dev))
    for x, y in zip(s["steps"], before["steps"]):
        assert x.item() == y.item() + 1
    assert not torch.equal(s["absmaxs"][2], before["absmaxs"][2])


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_unscale_and_lr_tensor_are_the_plain_step(dev, backend, bits, kind):
    """grad_scale = 4 (an exact reciprocal) is the step on grads / 4, and lr_tensor the step with
    its float32 value as lr: bit for bit."""
    op = op_name(kind, bits)
    require(op, dev, backend)
    c = make_state([(3000,), (17,)], BF16, FP32_MASTER, dev, 256, op=op)
    a, b = clone_state(c), clone_state(c)
    b["grads"] = [(g.float() / 4).to(g.dtype) for g in b["grads"]]
    lr = torch.tensor(0.0123, device=dev)
    kw = dict(block_size=256, master_mode=FP32_MASTER)
    step(op, a, backend, grad_scale=torch.tensor(4.0, device=dev), lr_tensor=lr, lr=99.0, **kw)
    step(op, b, backend, lr=lr.item(), **kw)
    for k in ("codes", "absmaxs", "masters", "steps", "params"):
        for x, y in zip(a[k], b[k]):
            assert bits_equal(x, y), k


@every_backend
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_empty_lists_and_empty_tensors(dev, backend, bits, kind):
    op = op_name(kind, bits)
    require(op, dev, backend)
    step(op, {k: [] for k in KEYS}, backend, block_size=256, qmap=qmap_for(op, dev))  # no work
    c = make_state([(0,), (0,)], F32, NONE, dev, 256, steps=[3, 3], op=op)
    step(op, c, backend, block_size=256)
    assert [s.item() for s in c["steps"]] == [4.0, 4.0]  # counters advance, as torch's


# ---- bad input: a clear error naming the argument, nothing changed -------------------------------
BAD = {  # what breaks the call (8-bit, native): the message must name it
    "block_size": lambda c, kw: kw.update(block_size=96),
    "absmaxs": lambda c, kw: c["absmaxs"].__setitem__(0, c["absmaxs"][0][:-1]),
    "qmap": lambda c, kw: kw.update(qmap=qm.unsigned_map()),  # +0 is its lowest entry
    "master": lambda c, kw: c.update(masters=[]),
    "8-bit codes": lambda c, kw: c["codes"].__setitem__(1, c["codes"][1].float()),
    "steps": lambda c, kw: c["steps"].pop(),
    "grads": lambda c, kw: c["grads"].__setitem__(0, c["grads"][0].half()),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises_before_anything_changes(kind, bad):
    op = op_name(kind, 8)
    require(op, "cpu", "native")
    c = make_state([(600,), (300,)], BF16, FP32_MASTER, "cpu", 256, op=op)
    tensors = [t for k in KEYS for t in c[k]]
    before = [t.clone() for t in tensors]
    kw = dict(block_size=256, master_mode=FP32_MASTER)
    BAD[bad](c, kw)
    with pytest.raises(RuntimeError, match=bad):
        step(op, c, "native", **kw)
    assert all(bits_equal(a, b) for a, b in zip(tensors, before))


@with_reference
@every_width
def test_sgd_needs_momentum(dev, backend, bits):
    op = op_name("sgd", bits)
    require(op, dev, backend)
    c = make_state([(10,)], F32, NONE, dev, 64, op=op)
    before = clone_state(c)
    with pytest.raises(RuntimeError, match="momentum must be > 0"):
        step(op, c, backend, momentum=0.0)
    assert unchanged(c, before)


@every_backend
@pytest.mark.parametrize("kind", KINDS)
def test_4bit_argument_errors_name_the_rule(dev, backend, kind):
    op = op_name(kind, 4)
    require(op, dev, backend)
    c = make_state([(300,)], F32, NONE, dev, 128, op=op)
    bad = {**clone_state(c), "codes": [torch.zeros(300, dtype=torch.uint8, device=dev)]}
    with pytest.raises(RuntimeError, match="ceil"):  # 8-bit sized codes
        step(op, bad, backend, block_size=128)
    with pytest.raises(RuntimeError, match="16"):
        step(op, clone_state(c), backend, block_size=128,
             qmap=torch.linspace(-1, 1, 256, device=dev))


def test_triton_8bit_argument_checks():
    if "triton" not in OPS["sgd8bit_step_"].available("cpu"):
        pytest.skip("no Triton (or TRITON_INTERPRET unset)")
    s = make_state([(100,)], F32, NONE, "cpu", 64)
    before = clone_state(s)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        step("lion8bit_step_", s, "triton", block_size=96)
    with pytest.raises(RuntimeError, match=r"lion8bit_step_: exp_avgs has 0 tensors, expected 1"):
        step("lion8bit_step_", {**s, "codes": []}, "triton")
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[0\] must be contiguous uint8"):
        step("sgd8bit_step_", {**s, "codes": [s["codes"][0].float()]}, "triton")
    with pytest.raises(RuntimeError, match=r"absmaxs\[0\] must be contiguous float32 with "
                                           r"ceil\(numel / block_size\) = 1 entries"):
        step("sgd8bit_step_", s, "triton", block_size=128)  # absmaxs hold 2 blocks of 64
    with pytest.raises(RuntimeError, match=r"grads\[0\] must have its param's dtype"):
        step("lion8bit_step_", {**s, "grads": [s["grads"][0].half()]}, "triton")
    args, kwargs = op_args("lion8bit_step_", s, qmap=qm.unsigned_map())  # no code below +0
    with pytest.raises(RuntimeError, match=r"lion8bit_step_: qmap \(signed map\) must hold \+0\.0 "
                                           r"above its lowest entry"):
        OPS["lion8bit_step_"](*args, **kwargs, backend="triton")
    bf = make_state([(100,)], BF16, NONE, "cpu", 64)
    with pytest.raises(RuntimeError, match="needs one master per param"):
        step("lion8bit_step_", bf, "triton", master_mode=FP32_MASTER)
    assert unchanged(s, before)  # a refused call writes nothing


# ---- dispatcher: bound lists, opcheck, torch.compile ---------------------------------------------
@every_width
@pytest.mark.parametrize("kind", KINDS)
def test_bound_lists_compute_the_plain_call(bits, kind):
    op = op_name(kind, bits)
    require(op, "cpu", "native")
    c = make_state([(500,), (3,), (0,)], BF16, REMAINDER, "cpu", 128, steps=[0, 0, 0], op=op)
    plain, bound = clone_state(c), clone_state(c)
    call = BoundOp(OPS[op], [bound["params"], bound["codes"], bound["absmaxs"],
                             bound["masters"], bound["steps"]], [4, 1, 9], [0, 8, 0])
    qmap = qmap_for(op)
    rest = dict(block_size=128, **{k: v for k, v in HYPER[kind].items()
                                   if k not in ("block_size", "master_mode")},
                master_mode=REMAINDER, grad_scale=None, found_inf=None, norm_sq=None,
                max_grad_norm=0.0, seed=5)
    for _ in range(2):
        OPS[op](plain["params"], plain["grads"], plain["codes"], plain["absmaxs"],
                plain["masters"], plain["steps"], qmap, **rest, param_ids=[4, 1, 9],
                elem_offsets=[0, 8, 0], backend="native")
        call(bound["grads"], qmap, **rest, backend="native")
    assert call._native is not None  # the C++ lists served the calls
    assert unchanged(plain, bound)


@every_width
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,mode", THREE_CASES + [(BF16, REMAINDER8)],
                         ids=["f32", "bf16-master", "bf16-remainder", "bf16-remainder8"])
def test_opcheck(bits, kind, dtype, mode):
    """Schema (scalars keyword-only), fake kernel and aot dispatch of the ops on CPU."""
    op = op_name(kind, bits)
    c = make_state([(301,)], dtype, mode, "cpu", 128, op=op)
    args, kwargs = op_args(op, c, block_size=128, weight_decay=0.01, master_mode=mode,
                           grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()), seed=3)
    torch.library.opcheck(OPS[op].overload, args, kwargs)


@pytest.mark.parametrize("cls", ["SGD4bit", "Lion4bit"])
def test_compiled_optimizer_step_equals_eager(cls, monkeypatch):
    """tests/test_compile_sgd_lion.py's check: fullgraph, bit-equal to eager, no recompile."""
    import mpfused
    from tests import test_compile_sgd_lion as tc
    kwargs = dict(min_8bit_size=256, **(dict(momentum=0.9, nesterov=True)
                                        if cls == "SGD4bit" else {}))
    monkeypatch.setitem(tc.CASES, cls, (getattr(mpfused, cls), kwargs,
                                        op_name(cls[:-4].lower(), 4)))
    torch._dynamo.reset()
    tc.counters.clear()
    eager = tc._optimizer_loop(False, getattr(mpfused, cls), kwargs)
    compiled = tc._optimizer_loop(True, getattr(mpfused, cls), kwargs)
    torch._dynamo.reset()
    assert any(t.dtype == torch.uint8 for t in compiled)  # 4-bit state was traced
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert 1 <= tc.counters["stats"]["unique_graphs"] <= 2
