"""Loss-scaling ops on every backend against the float64 reference (and torch's own ops)."""
import pytest
import torch

from mpfused.ops import OPS
from mpfused.ops import amp as amp_ops
from mpfused.reference import amp as ref
from tests.conftest import DTYPES
from tests.tolerances import assert_close

OP_UNDER_TEST = "unscale_grads_"
SIZES = [1, 7, 4097, 65537]  # odd sizes, chunk/block boundaries +-1 live in test_properties


def make_grads(device, dtypes=DTYPES, sizes=SIZES, scale=1024.0):
    grads = []
    for i, n in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        grads.append((torch.randn(n, device=device) * scale).to(dt))
    grads.append(torch.empty(0, device=device, dtype=dtypes[0]))
    # non-contiguous views: a transpose (dense) and a slice (not dense)
    grads.append((torch.randn(33, 17, device=device) * scale).to(dtypes[-1]).t())
    grads.append((torch.randn(9, 20, device=device) * scale).to(dtypes[0])[:, :5])
    return grads


def run_check(op_name, grads, backend, inv=1 / 1024.0, norms=True):
    device = grads[0].device
    found = torch.zeros((), device=device)
    inv_t = torch.tensor(inv, device=device)
    norm = torch.zeros((), device=device) if norms else None
    per = torch.zeros(len(grads), device=device) if norms else None
    OPS[op_name](grads, found, inv_t, norm_sq=norm, norm_sq_per_tensor=per, backend=backend)
    return found, norm, per


@pytest.mark.parametrize("write", [True, False])
def test_matches_reference(device, backend, write):
    op = "unscale_grads_" if write else "check_grads"
    grads = make_grads(device)
    expect = [g.clone() for g in grads]
    layout = [(g.data_ptr(), g.dtype, g.shape, g.stride()) for g in grads]
    found, norm, per = run_check(op, grads, backend)
    efound, enorm, eper = run_check(op, expect, "reference")
    assert found.item() == efound.item() == 0.0
    for g, e, lay in zip(grads, expect, layout):
        assert (g.data_ptr(), g.dtype, g.shape, g.stride()) == lay  # in place, layout kept
        assert_close(g, e)
    assert_close(norm, enorm, dtype=torch.float32, rtol=1e-5)
    assert_close(per, eper, dtype=torch.float32, rtol=1e-5)


def test_check_only_writes_nothing(device, backend):
    grads = make_grads(device)
    before = [g.clone() for g in grads]
    run_check("check_grads", grads, backend)
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("inv", [1 / 3, 1 / 1000.7, 0.7])
def test_finite_at_any_scale(device, backend, inv):
    """Finite grads stay finite when 1/scale is not a power of two, so most products x * inv are
    rounded (and some tiny ones are subnormal): a non-finite test on x*inv that compiles to the
    product's rounding error (an FMA-contracted x*inv - x*inv) flags them."""
    grads = make_grads(device)
    grads.append(torch.tensor([1e-38, -3e-39, 1.1754944e-38, 2.0**-126 * 1.5], device=device))
    expect = [g.clone() for g in grads]
    found, norm, _ = run_check("unscale_grads_", grads, backend, inv=inv)
    efound, enorm, _ = run_check("unscale_grads_", expect, "reference", inv=inv)
    assert found.item() == efound.item() == 0.0
    for g, e in zip(grads, expect):
        assert_close(g, e)
    assert_close(norm, enorm, dtype=torch.float32, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last_of_odd", "middle_tensor_only"])
def test_found_inf(device, backend, bad, where):
    grads = make_grads(device)
    target = {"first": (0, 0), "last_of_odd": (2, -1), "middle_tensor_only": (1, 3)}[where]
    grads[target[0]].view(-1)[target[1]] = bad
    found, _, _ = run_check("unscale_grads_", grads, backend, norms=False)
    assert found.item() == 1.0


def test_found_inf_never_cleared(device, backend):
    grads = make_grads(device)
    found = torch.ones((), device=device)
    OPS["check_grads"](grads, found, torch.ones((), device=device), norm_sq=None,
                       norm_sq_per_tensor=None, backend=backend)
    assert found.item() == 1.0


def test_many_small_tensors(device, backend):
    n = 300 if backend == "triton" else 3000  # the interpreter launches one program at a time
    grads = [torch.randn(int(k % 13) + 1, device=device).to(DTYPES[k % 3]) for k in range(n)]
    expect = [g.clone() for g in grads]
    found, norm, per = run_check("unscale_grads_", grads, backend, inv=0.5)
    efound, enorm, eper = run_check("unscale_grads_", expect, "reference", inv=0.5)
    assert found.item() == efound.item()
    for g, e in zip(grads, expect):
        assert_close(g, e)
    assert_close(per, eper, dtype=torch.float32, rtol=1e-5)


def test_norm_accumulates(device, backend):
    grads = make_grads(device)
    found = torch.zeros((), device=device)
    norm = torch.full((), 5.0, device=device)
    OPS["check_grads"](grads, found, torch.ones((), device=device), norm_sq=norm,
                       norm_sq_per_tensor=None, backend=backend)
    expect = 5.0 + sum(g.double().pow(2).sum().item() for g in grads)
    assert norm.item() == pytest.approx(expect, rel=1e-5)


def test_matches_torch_unscale(device, backend):
    """Same result as torch._amp_foreach_non_finite_check_and_unscale_ on fp32 grads."""
    grads = [torch.randn(n, device=device) * 4 for n in (5, 1000, 3)]
    theirs = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    amp_ops.unscale_grads_(grads, found, torch.tensor(0.25, device=device), backend=backend)
    tf = torch.zeros((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, tf, torch.tensor(0.25, device=device))
    for a, b in zip(grads, theirs):
        assert torch.equal(a, b)
    assert found.item() == tf.item()


def test_deterministic(device, backend):
    grads = make_grads(device)
    norms = [run_check("check_grads", grads, backend)[1].item() for _ in range(3)]
    assert norms[0] == norms[1] == norms[2]


@pytest.mark.skipif(not OPS[OP_UNDER_TEST].native_available("cpu"), reason="no native extension")
def test_errors():
    g = [torch.randn(4)]
    with pytest.raises(RuntimeError, match="found_inf must be a 1-element float32"):
        amp_ops.unscale_grads_(g, torch.zeros(2), torch.ones(()), backend="native")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        amp_ops.unscale_grads_([torch.ones(3, dtype=torch.float64)], torch.zeros(()),
                               torch.ones(()), backend="native")
    with pytest.raises(RuntimeError, match="sparse"):
        amp_ops.unscale_grads_([torch.ones(3).to_sparse()], torch.zeros(()), torch.ones(()),
                               backend="native")


@pytest.mark.parametrize("case", [
    # (found_inf sequence, growth_interval, hysteresis, min, max)
    ([0, 0, 1, 0, 1, 1, 0, 0, 0], 2, 1, 0.0, float("inf")),
    ([1, 1, 1, 0, 1, 0, 0, 1, 1], 2, 2, 0.0, float("inf")),
    ([1, 1, 1, 1, 1, 1, 1, 1, 1], 2, 1, 1.0, float("inf")),
    ([0, 0, 0, 0, 0, 0, 0, 0, 0], 1, 1, 0.0, 64.0),
])
def test_update_scale(device, backend, case):
    seq, interval, hyst, lo, hi = case
    states = []
    for be in (backend, "reference"):
        scale = torch.full((), 8.0, device=device)
        gt = torch.zeros((), dtype=torch.int32, device=device)
        ht = torch.full((), hyst, dtype=torch.int32, device=device)
        traj = []
        for f in seq:
            OPS["update_scale_"](scale, gt, ht, torch.tensor(float(f), device=device),
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=interval, hysteresis=hyst, min_scale=lo,
                                 max_scale=hi, backend=be)
            traj.append((scale.item(), gt.item(), ht.item()))
        states.append(traj)
    assert states[0] == states[1]


@pytest.mark.parametrize("growth,backoff", [(1.5, 0.7), (1.001, 0.9)])
def test_update_scale_any_factors(device, backend, growth, backoff):
    """Factors whose products are rounded: the grown scale is finite and must be taken (a
    finiteness test compiled into the product's rounding error would refuse it)."""
    states = []
    for be in (backend, "reference"):
        scale = torch.full((), 3.0, device=device)
        gt = torch.zeros((), dtype=torch.int32, device=device)
        ht = torch.ones((), dtype=torch.int32, device=device)
        traj = []
        for f in [0, 0, 0, 1, 0, 0, 0, 0]:
            OPS["update_scale_"](scale, gt, ht, torch.tensor(float(f), device=device),
                                 growth_factor=growth,
                                 backoff_factor=backoff, growth_interval=1, hysteresis=1,
                                 min_scale=0.0, max_scale=float("inf"), backend=be)
            traj.append(scale.item())
        states.append(traj)
    assert states[0] == states[1]
    assert states[0][2] > 3.0 * growth  # grown at every step before the inf


def test_update_scale_matches_torch(device, backend):
    """hysteresis off, no bounds: bit-for-bit torch._amp_update_scale_, growth refused at inf."""
    for init in (4.0, 3.0e38):
        a, ga = torch.full((), init, device=device), torch.zeros((), dtype=torch.int32, device=device)
        b, gb = a.clone(), ga.clone()
        ht = torch.ones((), dtype=torch.int32, device=device)
        for f in [0, 0, 1, 0, 0, 0, 1, 0]:
            fi = torch.tensor(float(f), device=device)
            OPS["update_scale_"](a, ga, ht, fi, growth_factor=2.0, backoff_factor=0.25,
                                 growth_interval=2, hysteresis=1, min_scale=0.0,
                                 max_scale=float("inf"), backend=backend)
            torch._amp_update_scale_(b, gb, fi, 2.0, 0.25, 2)
            assert (a.item(), ga.item()) == (b.item(), gb.item())


@pytest.mark.parametrize("name", ["unscale_grads_", "check_grads"])
def test_opcheck(name):
    grads = [torch.randn(5), torch.randn(3, 4).bfloat16()]
    args = (grads, torch.zeros(()), torch.tensor(0.5))
    kwargs = dict(norm_sq=torch.zeros(()), norm_sq_per_tensor=torch.zeros(2))
    torch.library.opcheck(OPS[name].overload, args, kwargs)


def test_opcheck_update_scale():
    args = (torch.full((), 4.0), torch.zeros((), dtype=torch.int32),
            torch.ones((), dtype=torch.int32), torch.zeros(()))
    kwargs = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=1,
                  min_scale=0.0, max_scale=1e30)
    torch.library.opcheck(OPS["update_scale_"].overload, args, kwargs)


def test_compile_fullgraph():
    grads = [torch.randn(10), torch.randn(7).bfloat16()]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(gs, found, inv):
        torch.ops.mpfused.unscale_grads_(gs, found, inv)
        return found + 0

    found = step(grads, torch.zeros(()), torch.tensor(0.5))
    assert found.item() == 0.0
