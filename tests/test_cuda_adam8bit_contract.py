"""Native CUDA adam8bit_step_ beyond the reference comparison (moved from tests/test_cuda_adam8bit.py,
whose helpers, method and skips these use): bit for bit against the native CPU kernel, skip on
found_inf, bad maps, errors, the optimizer on CUDA without host sync, CUDA graphs, opcheck, 64-bit
indexing."""
import contextlib

import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import OPS
from mpfused.reference import adam8bit as ref8
from tests.test_cuda_adam8bit import (A1, A2, C1, C2, DEV, MA, MASTER_FP32, MASTER_NONE, MIXED,
                                      MODES, OP, SIZES, G, P, Q8Case, S, assert_absmax_close,
                                      assert_codes_close, assert_lists_equal, clone_lists,
                                      dtype_cycle, native, no_host_sync, scalar)
from tests.test_cuda_adam8bit import pytestmark  # noqa: F401  (its skips: no GPU, no CUDA build)
from tests.tolerances import assert_close


# ---- against the native CPU kernel, bit for bit ---------------------------------------------------

@pytest.mark.parametrize("block", [64, 128, 256, 1024, 4096])
@pytest.mark.parametrize("mode", MODES)
def test_matches_cpu_kernel_bitwise(mode, block):
    if not OPS[OP].native_available("cpu"):
        pytest.skip("no native CPU kernel")
    case = Q8Case(SIZES, dtype_cycle(MIXED, len(SIZES), mode), mode, block=block, grad_scale=256.0,
                  clip=True, lr_kind="cuda32", layouts=("contig", "offset", "contig"))
    cpu = clone_lists(case.lists(), device="cpu")
    native(*case.args(case.lists()), **case.kwargs())
    OPS[OP](*case.args(cpu, device="cpu"), **case.kwargs(device="cpu"), backend="native")
    assert_lists_equal(case.lists(), cpu)


# ---- skip, bad maps, errors -----------------------------------------------------------------------

@pytest.mark.parametrize("found", [1.0, 2.0, float("inf")])
@pytest.mark.parametrize("layout", ["contig", "transposed"])
def test_skips_on_found_inf_bit_identical(found, layout):
    shapes = [(300, 257), (64, 65), (3, 5), (0, 2), (70, 1030)]
    case = Q8Case(shapes, dtype_cycle(MIXED, len(shapes)), MASTER_FP32, layouts=(layout,),
                  grad_scale=1024.0, clip=True)
    case.found_inf.fill_(found)
    before = clone_lists(case.lists())
    native(*case.args(case.lists()), **case.kwargs())
    assert_lists_equal(case.lists(), before, "a found_inf step must change nothing: ")


@pytest.mark.parametrize("found", [0.0, -1.0, float("nan")])
def test_found_inf_not_positive_runs(found):
    # The skip rule is found_inf > 0 (NaN > 0 is false, as in the reference).
    case = Q8Case([1000, 5000], [torch.bfloat16, torch.float32], MASTER_FP32)
    case.found_inf.fill_(found)
    case.step_and_compare()


@pytest.mark.parametrize("bad", ["unsorted", "no_zero", "zero_first"])
def test_bad_map_poisons_absmax_and_writes_nothing_else(bad):
    case = Q8Case([1000, 4097, 3], dtype_cycle(MIXED, 3), MASTER_FP32)
    q1 = case.qmap1.clone()
    if bad == "unsorted":
        q1[[10, 11]] = q1[[11, 10]]
    elif bad == "no_zero":
        q1[127] = q1[128] * 0.5
    else:
        q1 = case.qmap2.clone()  # +0 at index 0
    case.qmap1 = q1
    before = clone_lists(case.lists())
    native(*case.args(case.lists()), **case.kwargs())
    for k in (P, C1, C2, MA):
        for a, b in zip(case.lists()[k], before[k]):
            assert torch.equal(a, b)
    for k in (A1, A2):
        for a in case.lists()[k]:
            assert bool(a.isnan().all())


def test_errors():
    case = Q8Case([10, 300], [torch.bfloat16] * 2, MASTER_FP32)
    lists = case.lists()
    with pytest.raises(RuntimeError, match="qmap1"):
        cpu_map = case.args(lists)
        cpu_map = (*cpu_map[:8], qm.signed_map("cpu"), *cpu_map[9:])
        OPS[OP](*cpu_map, **case.kwargs(), backend="native")
    with pytest.raises(RuntimeError, match="absmax"):
        OPS[OP](*case.args(lists[:4] + [[a[:-1] for a in lists[A1]]] + lists[5:]),
                **case.kwargs(), backend="native")
    with pytest.raises(RuntimeError, match="block_size"):
        OPS[OP](*case.args(lists), **{**case.kwargs(), "block_size": 96}, backend="native")
    with pytest.raises(RuntimeError, match="master"):
        OPS[OP](*case.args(lists[:6] + [[]] + lists[7:]), **case.kwargs(), backend="native")
    case.grad_scale = torch.tensor(2.0)  # on the CPU
    with pytest.raises(RuntimeError, match="grad_scale"):
        OPS[OP](*case.args(lists), **case.kwargs(), backend="native")


def test_optimizer_picks_native_cuda_and_needs_no_sync():
    import mpfused

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    model = model.to(DEV)
    opt = mpfused.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=0)
    assert OPS[OP].route("cuda") == "native"
    for it in range(3):
        loss = model(torch.randn(32, 64, device=DEV)).square().mean()
        loss.backward()
        # The first step creates the state (host work); later ones are one kernel per bucket.
        with no_host_sync() if it else contextlib.nullcontext():
            opt.step()
        opt.zero_grad(set_to_none=False)
    assert any(s["exp_avg"].dtype == torch.uint8 for s in opt.state.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- CUDA graphs and opcheck ------------------------------------------------------------------

def test_cuda_graph_capture_matches_eager():
    shapes = [1000, 65537, 3, 4096, (64, 33)]
    case = Q8Case(shapes, dtype_cycle(MIXED, len(shapes)), MASTER_FP32, grad_scale=1024.0,
                  clip=True, lr_kind="cuda32")
    eager = clone_lists(case.lists())
    snapshot = clone_lists(case.lists())

    def restore():
        for dst, src in zip(case.lists(), snapshot):
            for a, b in zip(dst, src):
                a.copy_(b)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (lazy module loading etc.)
        native(*case.args(case.lists()), **case.kwargs())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native(*case.args(case.lists()), **case.kwargs())
    restore()

    for it in range(5):
        found = 1.0 if it == 2 else 0.0
        case.found_inf.fill_(found)
        for g, ge in zip(case.grads, eager[G]):
            new = (torch.randn(g.shape, device=DEV) * 1024.0).to(g.dtype)
            g.copy_(new)
            ge.copy_(new)
        before = clone_lists(case.lists())
        graph.replay()
        native(*case.args(eager), **case.kwargs())
        torch.cuda.synchronize()
        assert_lists_equal(case.lists(), eager, f"replay {it}: ")
        if found:
            assert_lists_equal(case.lists(), before, "skipped replay: ")
        else:
            assert all(s.item() == b.item() + 1 for s, b in zip(case.steps, before[S]))


@pytest.mark.parametrize("mode", MODES)
def test_opcheck(mode):
    case = Q8Case([7, (4, 3), 0, 1000], dtype_cycle(MIXED, 4, mode), mode, grad_scale=8.0, clip=True,
                  lr_kind="cuda32")
    torch.library.opcheck(OPS[OP].overload, case.args(case.lists()), case.kwargs())


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 24 * 2**30,
                    reason="needs 24 GB of free GPU memory (uses ~13 GB)")
def test_beyond_int32_elements():
    n = 2**31 + 777
    block = 256
    start = 2**31 - 4096  # block-aligned: the tail's absmax are absmax[start // block:]
    p = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    g = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    c1 = torch.full((n,), 127, dtype=torch.uint8, device=DEV)  # +0 of the signed map
    c2 = torch.zeros(n, dtype=torch.uint8, device=DEV)
    nb = (n + block - 1) // block
    a1 = torch.zeros(nb, device=DEV)
    a2 = torch.zeros(nb, device=DEV)
    tail = slice(start, n)
    p[tail] = torch.randn(n - start, device=DEV).bfloat16()
    g[tail] = torch.randn(n - start, device=DEV).bfloat16()
    saved = [x[tail].clone() for x in (p, g, c1, c2)] + [x[start // block:].clone() for x in (a1, a2)]
    maps = (qm.signed_map(DEV), qm.unsigned_map(DEV))
    hyper = dict(block_size=block, lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.01, maximize=False, decoupled=True, master_mode=MASTER_NONE,
                 grad_scale=None, found_inf=None, norm_sq=None, max_grad_norm=0.0, seed=0)
    step = scalar(0.0)
    native([p], [g], [c1], [c2], [a1], [a2], [], [step], *maps, **hyper)
    sp, sg, sc1, sc2, sa1, sa2 = saved
    ref8.adam8bit_step_([sp], [sg], [sc1], [sc2], [sa1], [sa2], [], [scalar(0.0)], *maps, **hyper)
    assert_close(p[tail], sp)
    assert_codes_close(c1[tail], sc1)
    assert_codes_close(c2[tail], sc2)
    assert_absmax_close(a1[start // block:], sa1, torch.zeros(0), A1)
    assert_absmax_close(a2[start // block:], sa2, torch.zeros(0), A2)
    assert step.item() == 1.0
    del p, g, c1, c2, a1, a2
    torch.cuda.empty_cache()
