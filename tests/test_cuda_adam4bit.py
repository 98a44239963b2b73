"""Native CUDA adam4bit_step_ (csrc/cuda/adam8bit_cuda.cu specialized on 4-bit codes, via
csrc/bindings/adam8bit_ops_cuda.cpp) against the native CPU kernel, byte for byte, and against
mpfused.reference.adam4bit.

The CUDA and CPU kernels run the same fp32 operations in the same order (no FMA contraction, IEEE
division and square root; the 4-bit encoders over +inf-padded thresholds return the same nearest
code), so params, masters, packed codes (the odd tail's zero low nibble included), absmax and step
counters must be identical: every dtype x master mode (remainder8 included) x block size, odd
sizes, operands one element (codes: one byte) past an aligned start, strided and transposed
params (staged), loss scale, clipping, device lr, several launches. Every CUDA call runs under
torch.cuda.set_sync_debug_mode("error"). Skipped without a GPU or when the extension was built
without its CUDA kernels (tests/test_cuda_emulation.py runs the same kernel on the host against
the CPU kernel, byte for byte, for both code widths)."""
import pytest
import torch

from mpfused import quant4
from mpfused.ops import OPS
from tests.test_cuda_adam8bit import (A1, A2, C1, C2, DEV, MA, MASTER_FP32, MASTER_NONE,
                                      MASTER_REMAINDER8, MASTER_STOCHASTIC, MIXED, MODES, P,
                                      SIZES, Q8Case, assert_lists_equal, clone_lists,
                                      dtype_cycle, native, pytestmark)  # noqa: F401

OP = "adam4bit_step_"


def case4(shapes, dtypes, mode, **kw):
    return Q8Case(shapes, dtypes, mode, bits=4, **kw)


def run_both(case):
    """One step of the CUDA kernel on the case and of the CPU kernel on a CPU copy: the CPU lists."""
    cpu = clone_lists(case.lists(), device="cpu")
    native(*case.args(case.lists()), op=OP)
    OPS[OP](*case.args(cpu, device="cpu"), backend="native")
    return cpu


def require_cpu_kernel():
    if not OPS[OP].native_available("cpu"):
        pytest.skip("no native CPU kernel")


# ---- against the native CPU kernel, byte for byte ------------------------------------------------

@pytest.mark.parametrize("block", [64, 128, 256, 1024, 4096])
@pytest.mark.parametrize("mode", MODES)
def test_matches_cpu_kernel_bytewise(mode, block):
    require_cpu_kernel()
    case = case4(SIZES, dtype_cycle(MIXED, len(SIZES), mode), mode, block=block, grad_scale=256.0,
                 clip=True, lr_kind="cuda32", layouts=("contig", "offset", "contig"),
                 maximize=block == 1024, decoupled=block != 64)
    for _ in range(2):  # the second step starts from the kernel's own 4-bit state
        cpu = run_both(case)
        assert_lists_equal(case.lists(), cpu)


@pytest.mark.parametrize("layouts", [("offset",), ("strided",), ("transposed",),
                                     ("contig", "offset", "strided", "transposed")], ids=str)
@pytest.mark.parametrize("mode", [MASTER_FP32, MASTER_REMAINDER8])
def test_noncontiguous_and_misaligned_bytewise(mode, layouts):
    require_cpu_kernel()
    shapes = [(37, 129), (300, 257), (1, 5), (0, 4), (1030, 69), (2, 3), (64, 65)]
    case = case4(shapes, dtype_cycle(MIXED, len(shapes), mode), mode, layouts=layouts, block=128)
    strides = [p.stride() for p in case.params]
    cpu = run_both(case)
    assert_lists_equal(case.lists(), cpu)
    assert [p.stride() for p in case.params] == strides


def test_many_small_tensors_bytewise():
    require_cpu_kernel()
    shapes = torch.randint(0, 600, (300,)).tolist()  # several launches, odd sizes
    case = case4(shapes, dtype_cycle(MIXED, len(shapes)), MASTER_STOCHASTIC, block=128)
    cpu = run_both(case)
    assert_lists_equal(case.lists(), cpu)


def test_first_step_and_odd_tails_bytewise():
    require_cpu_kernel()
    sizes = [1, 3, 5, 127, 129, 4095, 4097, 8191]
    case = case4(sizes, dtype_cycle(MIXED, len(sizes)), MASTER_FP32, fresh=True, block=128)
    cpu = run_both(case)
    assert_lists_equal(case.lists(), cpu)
    for c, p in zip(case.c1 + case.c2, case.params + case.params):
        if p.numel() % 2:  # the padding nibble of an odd size stays 0
            assert int(c[-1].item()) & 0xF == 0


def test_nonfinite_grads_bytewise():
    """NaN / inf grads without found_inf reach the moments: NaN absmax, the same on both."""
    require_cpu_kernel()
    case = case4([1000, 4097, 3], dtype_cycle(MIXED, 3, MASTER_REMAINDER8), MASTER_REMAINDER8, block=128)
    for g in case.grads:
        g.view(-1)[::97] = float("nan")
        g.view(-1)[1::131] = float("inf")
    cpu = run_both(case)
    assert_lists_equal(case.lists(), cpu)
    assert all(bool(a.isnan().any()) for a in case.a1 + case.a2)


# ---- against the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, MIXED], ids=str)
def test_matches_reference(dtype, mode):
    case = case4(SIZES, dtype_cycle(dtype, len(SIZES), mode), mode, block=128)
    for _ in range(2):
        case.step_and_compare()


# ---- skip, maps, errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("found", [1.0, float("inf")])
def test_skips_on_found_inf_bit_identical(found):
    shapes = [(300, 257), (64, 65), (3, 5), (0, 2), (70, 1031)]
    case = case4(shapes, dtype_cycle(MIXED, len(shapes)), MASTER_FP32, layouts=("transposed",),
                 grad_scale=1024.0, clip=True)
    case.found_inf.fill_(found)
    before = clone_lists(case.lists())
    native(*case.args(case.lists()), op=OP)
    assert_lists_equal(case.lists(), before, "a found_inf step must change nothing: ")


def test_unsorted_map_poisons_absmax_and_writes_nothing_else():
    case = case4([1000, 4097, 3], dtype_cycle(MIXED, 3), MASTER_FP32)
    q1 = case.qmap1.clone()
    q1[[5, 6]] = q1[[6, 5]]
    case.qmap1 = q1
    before = clone_lists(case.lists())
    native(*case.args(case.lists()), op=OP)
    for k in (P, C1, C2, MA):
        for a, b in zip(case.lists()[k], before[k]):
            assert torch.equal(a, b)
    for k in (A1, A2):
        for a in case.lists()[k]:
            assert bool(a.isnan().all())


def test_map_without_zero_is_used_as_it_is():
    """4-bit: no sign rule, so a sorted map needs no +0 (the 8-bit kernel would poison absmax)."""
    require_cpu_kernel()
    case = case4([1000, 4097, 3], dtype_cycle(MIXED, 3), MASTER_NONE)
    case.qmap1 = case.qmap2.clone()  # the zero-free linear map as the first moment's map
    cpu = clone_lists(case.lists(), device="cpu")
    native(*case.args(case.lists()), op=OP)
    OPS[OP](*case.args(cpu, device="cpu")[:8], case.qmap1.cpu(), case.qmap2.cpu(),
            *case.args(cpu, device="cpu")[10:], backend="native")
    assert_lists_equal(case.lists(), cpu)
    assert not any(bool(a.isnan().any()) for a in case.a1 + case.a2)


def test_errors():
    case = case4([10, 301], [torch.bfloat16] * 2, MASTER_FP32)
    lists = case.lists()
    with pytest.raises(RuntimeError, match="qmap1"):  # a 256-entry map
        a = case.args(lists)
        OPS[OP](*a[:8], torch.linspace(-1, 1, 256, device=DEV), *a[9:], backend="native")
    with pytest.raises(RuntimeError, match="exp_avgs"):  # 8-bit sized codes
        a = list(case.args(lists))
        a[C1] = [torch.zeros(p.numel(), dtype=torch.uint8, device=DEV) for p in case.params]
        OPS[OP](*a, backend="native")
    with pytest.raises(RuntimeError, match="exp_avg_sqs"):  # not contiguous
        a = list(case.args(lists))
        a[C2] = [torch.zeros(2 * quant4.codes4_numel(p.numel()), dtype=torch.uint8,
                             device=DEV)[::2] for p in case.params]
        OPS[OP](*a, backend="native")


def test_optimizer_picks_native_cuda_and_needs_no_sync():
    import contextlib

    import mpfused
    from tests.test_cuda_adam8bit import no_host_sync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 7))
    model = model.to(DEV)
    opt = mpfused.AdamW4bit(model.parameters(), lr=1e-3, min_8bit_size=0)
    assert OPS[OP].route("cuda") == "native"
    for it in range(3):
        loss = model(torch.randn(32, 64, device=DEV)).square().mean()
        loss.backward()
        with no_host_sync() if it else contextlib.nullcontext():
            opt.step()
        opt.zero_grad(set_to_none=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_opcheck():
    case = case4([7, (4, 3), 0, 1001], dtype_cycle(MIXED, 4, MASTER_REMAINDER8), MASTER_REMAINDER8, grad_scale=8.0,
                 clip=True, lr_kind="cuda32", block=64)
    torch.library.opcheck(OPS[OP].overload, case.args(case.lists()))
