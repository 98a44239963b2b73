"""BoundOp (mpfused/ops/bound.py): a step op called with its operand lists bound once on the C++
side computes exactly what the plain op call computes (bit for bit, same kernel), falls back to
the plain call off the native backend, and rejects mis-bound lists with a clear error. Also: the
step ops pass autograd straight through (no boxed fallback), as torch's fused optimizer ops do."""
import pytest
import torch

import mpfused
from mpfused import _extension
from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from tests.conftest import DEVICES
from tests.test_adam_kernels import (ARG_ORDER, BF16, F16, F32, FP32_MASTER, HYPER, KEYS, NONE,
                                     REMAINDER, STOCHASTIC, bits_equal, clone_state, make_state)

OP_UNDER_TEST = "adam_step_"  # the (device, backend) parametrization of tests/conftest.py
needs_native = pytest.mark.skipif(_extension.load() is None, reason="native extension not built")
SHAPES = [(1,), (0,), (7,), (4097,), (5, 13), (300,)]
ADAM_CASES = [(F32, NONE, False), (F32, NONE, True), (BF16, FP32_MASTER, True),
              (F16, FP32_MASTER, False), (BF16, REMAINDER, False), (BF16, STOCHASTIC, False)]


def _adam_lists(s):
    return [s[k] for k in KEYS if k != "grads"]


def _adam_rest(**kw):
    """The op's keyword arguments but param_ids, elem_offsets (a BoundOp binds those)."""
    h = {**HYPER, **kw}
    return {k: h[k] for k in ARG_ORDER if k not in ("param_ids", "elem_offsets")}


# stochastic-rounding keys other than the defaults, bound once and passed to the plain call
IDS, OFFSETS = [5, 9, 2, 40, 41, 3], [0, 0, 100, 0, 7, 1 << 40]


class _NoPlainCall:
    """The op, with its plain (all lists from Python) call refused: the bound path must serve."""

    def __init__(self, op):
        self.name, self.native_available = op.name, op.native_available
        self.keyword_args = op.keyword_args

    def __call__(self, *args, **kwargs):
        raise AssertionError("BoundOp made the plain call")


def _assert_same(a, b):
    for k in a:
        for x, y in zip(a[k], b[k]):
            assert bits_equal(x, y), k


def _native_on(dev: str, op: str):
    if not OPS[op].native_available(dev):
        pytest.skip(f"no native {op} kernel for {dev} in this build")


@needs_native
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype,mode,amsgrad", ADAM_CASES,
                         ids=[f"{str(d)[6:]}-m{m}-ams{int(a)}" for d, m, a in ADAM_CASES])
def test_bound_adam_step_equals_plain_call(dev, dtype, mode, amsgrad):
    _native_on(dev, "adam_step_")
    s = make_state(SHAPES, dtype, mode, amsgrad, dev)
    # a transposed (dense, non-contiguous) param: its moments share its strides
    for k in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters"):
        if s[k]:
            s[k][4] = s[k][4].t().contiguous().t()
    assert not s["params"][4].is_contiguous()
    plain, bound = clone_state(s), clone_state(s)
    rest = _adam_rest(amsgrad=amsgrad, master_mode=mode, grad_scale=torch.tensor(4.0, device=dev),
                      found_inf=torch.zeros((), device=dev), norm_sq=torch.tensor(9.0, device=dev),
                      max_grad_norm=1.0, seed=11)
    call = BoundOp(_NoPlainCall(OPS["adam_step_"]), _adam_lists(bound), IDS, OFFSETS)
    for _ in range(3):
        OPS["adam_step_"](*(plain[k] for k in KEYS), **rest, param_ids=IDS, elem_offsets=OFFSETS,
                          backend="native")
        call(bound["grads"], **rest, backend="native")
    _assert_same(plain, bound)
    assert float(bound["steps"][0]) == float(s["steps"][0]) + 3
    # found_inf > 0: nothing changes, step counters included
    before = clone_state(bound)
    call(bound["grads"], **_adam_rest(amsgrad=amsgrad, master_mode=mode,
                                      found_inf=torch.ones((), device=dev)), backend="native")
    _assert_same(before, bound)


@needs_native
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype,mode", [(F32, 0), (BF16, 1), (BF16, 2), (F16, 0)])
def test_bound_adam8bit_step_equals_plain_call(dev, dtype, mode):
    _native_on(dev, "adam8bit_step_")
    block = 256
    sizes = [700, 256, 1, 0, 4099]
    states = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(99)
        lists = [[] for _ in range(8)]  # params, grads, codes1, codes2, absmax1, absmax2, masters, steps
        for n in sizes:
            p32 = torch.randn(n, generator=gen) * 0.1
            lists[0].append(p32.to(dtype))
            lists[1].append((torch.randn(n, generator=gen) * 0.01).to(dtype))
            c1, a1 = qm.quantize_blockwise(torch.randn(n, generator=gen) * 1e-3, qm.signed_map(), block)
            c2, a2 = qm.quantize_blockwise(torch.rand(n, generator=gen) * 1e-5, qm.unsigned_map(), block)
            for k, t in zip((2, 3, 4, 5), (c1, c2, a1, a2)):
                lists[k].append(t)
            if mode == 1:
                lists[6].append(p32 + 1e-5)
            elif mode == 2:
                lists[6].append(torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int16))
            lists[7].append(torch.full((), 4.0))
        states.append([[t.to(dev) for t in ts] for ts in lists])
    plain, bound = states
    maps = (qm.signed_map(dev), qm.unsigned_map(dev))
    rest = dict(block_size=block, lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=1e-2, maximize=False, decoupled=True, master_mode=mode,
                grad_scale=torch.tensor(2.0, device=dev), found_inf=torch.zeros((), device=dev),
                norm_sq=torch.tensor(4.0, device=dev), max_grad_norm=1.0, seed=7)
    ids, offsets = IDS[:len(sizes)], OFFSETS[:len(sizes)]
    call = BoundOp(_NoPlainCall(OPS["adam8bit_step_"]), [bound[0]] + bound[2:], ids, offsets)
    for _ in range(2):
        OPS["adam8bit_step_"](*plain, *maps, **rest, param_ids=ids, elem_offsets=offsets,
                              backend="native")
        call(bound[1], *maps, **rest, backend="native")
    for a, b in zip(plain, bound):
        for x, y in zip(a, b):
            assert bits_equal(x, y)
    assert float(bound[7][0]) == 6.0


def test_bound_op_off_native_is_the_plain_call():
    """The reference backend (and Triton, torch.compile) get the plain lists."""
    s = make_state(SHAPES, BF16, FP32_MASTER, False, "cpu")
    plain, bound = clone_state(s), clone_state(s)
    rest = _adam_rest(master_mode=FP32_MASTER)
    OPS["adam_step_"](*(plain[k] for k in KEYS), **rest, param_ids=IDS, elem_offsets=OFFSETS,
                      backend="reference")
    BoundOp(OPS["adam_step_"], _adam_lists(bound), IDS, OFFSETS)(bound["grads"], **rest,
                                                                 backend="reference")
    _assert_same(plain, bound)


@needs_native
def test_bound_lists_reject_wrong_binding():
    s = make_state([(3,)], F32, NONE, False, "cpu")
    lists = _adam_lists(s)
    with pytest.raises(RuntimeError, match="adam_step_ needs the 6 lists"):
        BoundOp(OPS["adam_step_"], lists[:5])(s["grads"], **_adam_rest(), backend="native")
    with pytest.raises(RuntimeError, match="lengths sum to 3 but 4 tensors"):
        torch.classes.mpfused.BoundLists([t for ts in lists for t in ts], [1, 1, 1, 0, 0, 0],
                                         [], [])
    with pytest.raises(RuntimeError, match="adam8bit_step_ needs the 7 lists"):
        rest = {k: v for k, v in _adam_rest().items() if k != "amsgrad"}
        BoundOp(OPS["adam8bit_step_"], lists)(s["grads"], qm.signed_map(), qm.unsigned_map(),
                                              block_size=256, **rest, backend="native")
    # the op's own checks still run: a grad of the wrong length
    with pytest.raises(RuntimeError, match="same length"):
        BoundOp(OPS["adam_step_"], lists)(s["grads"] * 2, **_adam_rest(), backend="native")


@needs_native
@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.AdamW8bit])
@pytest.mark.parametrize("dev", DEVICES)
def test_optimizers_step_through_bound_lists(dev, cls):
    _native_on(dev, "adam_step_")
    model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Linear(64, 3)).to(dev)
    opt = cls(model.parameters(), lr=1e-3)
    model(torch.randn(4, 80, device=dev)).sum().backward()
    opt.step()
    buckets = [b for plan in opt._plans.values() for b in plan.buckets]
    assert buckets and all(isinstance(b.state["step_"]._native, torch.ScriptObject) for b in buckets)
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())


@pytest.mark.parametrize("name", sorted(OPS))
def test_step_ops_pass_autograd_through(name):
    """No outputs, no derivative: the Autograd key falls through to the kernel (torch's boxed
    fallback would convert every tensor list twice)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(OPS[name].qualname, "Autograd")


@pytest.mark.parametrize("via", ["registry", "dispatcher"])
def test_step_op_under_grad_mode_updates_like_no_grad(device, backend, via):
    """As torch._fused_adamw_: called outside no_grad on params that require grad, the step still
    updates in place and attaches no graph, on every backend (the reference included, reached
    through the registry or through the dispatcher)."""
    if via == "dispatcher" and backend != "native" and OPS["adam_step_"].native_available(device):
        pytest.skip("the dispatcher serves this device natively")
    s = make_state([(5,), (3, 2)], F32, NONE, False, device)
    a, b = clone_state(s), clone_state(s)
    for p in a["params"]:
        p.requires_grad_(True)
    run = (OPS["adam_step_"].overload if via == "dispatcher"
           else lambda *args, **kwargs: OPS["adam_step_"](*args, **kwargs, backend=backend))
    run(*(a[k] for k in KEYS), **_adam_rest())
    with torch.no_grad():
        run(*(b[k] for k in KEYS), **_adam_rest())
    for x, y in zip(a["params"], b["params"]):
        assert x.grad_fn is None and torch.equal(x.detach(), y)


@pytest.mark.parametrize("cls", [mpfused.AdamW, mpfused.AdamW8bit])
def test_compiled_optimizer_step_equals_eager(cls):
    """torch.compile(opt.step) traces the plain op call (BoundLists is never traced) and
    steps exactly as the eager optimizer."""
    torch._dynamo.reset()
    model = torch.nn.Linear(80, 64)  # 5,120 weights: an 8-bit bucket for AdamW8bit
    twin = torch.nn.Linear(80, 64)
    twin.load_state_dict(model.state_dict())
    opt, opt_eager = cls(model.parameters(), lr=1e-2), cls(twin.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(4, 80)
        for mod in (model, twin):
            mod.zero_grad()
            mod(x).sum().backward()
        step()
        opt_eager.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
