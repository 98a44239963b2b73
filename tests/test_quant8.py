"""The 8-bit dynamic maps and the block-wise codec: byte-equality with bitsandbytes, nearest-code
encoding (pure torch and inside every backend of the op), exact round trips, bnb's error bounds."""
import math

import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import adam8bit as ops

OP_UNDER_TEST = "adam8bit_step_"


@pytest.mark.parametrize("signed", [True, False])
def test_maps_byte_equal_to_bitsandbytes(signed):
    F = pytest.importorskip("bitsandbytes.functional")
    ours, theirs = qm.create_dynamic_map(signed=signed), F.create_dynamic_map(signed=signed)
    assert ours.dtype == theirs.dtype == torch.float32
    assert ours.numpy().tobytes() == theirs.numpy().tobytes()


def test_map_properties():
    s, u = qm.signed_map(), qm.unsigned_map()
    for m in (s, u):
        assert m.numel() == 256 and torch.unique(m).numel() == 256
        assert bool((m[1:] > m[:-1]).all()) and m[-1].item() == 1.0
    assert s[qm.SIGNED_ZERO_CODE].item() == 0.0 and not torch.signbit(s[127])
    assert u[qm.UNSIGNED_ZERO_CODE].item() == 0.0
    assert s[0].item() == pytest.approx(-0.99296875) and s[126].item() == pytest.approx(-5.5e-7)
    assert qm.zero_code(s) == 127 and qm.zero_code(u) == 0


@pytest.mark.parametrize("signed", [True, False])
def test_thresholds_are_exact_midpoints(signed):
    m = qm.create_dynamic_map(signed).double()
    thr = qm.thresholds(qm.create_dynamic_map(signed))
    mid = (m[:-1] + m[1:]) / 2
    below = thr[:-1].double()
    above = torch.nextafter(thr[:-1], torch.tensor(math.inf)).double()
    assert bool((below <= mid).all()) and bool((above > mid).all())
    assert thr[-1].item() == math.inf


def _probe_values(qmap: torch.Tensor) -> torch.Tensor:
    """Random values plus every float32 neighbour of every decision point and map entry."""
    thr = qm.thresholds(qmap)[:-1]
    pts = torch.cat([thr, qmap])
    up = torch.nextafter(pts, torch.tensor(math.inf))
    down = torch.nextafter(pts, torch.tensor(-math.inf))
    mids = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()  # ties where representable
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 3e-8, -3e-8, 1e-30,
                            -1e-30, 2.0, -2.0])
    rnd = torch.cat([torch.randn(20000) * 0.3, torch.rand(20000) * 2 - 1,
                     torch.randn(5000) * 1e-5])
    return torch.cat([pts, up, down, mids, special, rnd]).float()


def _brute_nearest(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    # float64 distances (exact for these operands); argmin returns the first (lower) index on ties
    return (x.double()[:, None] - qmap.double()[None, :]).abs().argmin(dim=1)


@pytest.mark.parametrize("signed", [True, False])
def test_encode_equals_brute_force_nearest(signed):
    qmap = qm.create_dynamic_map(signed)
    x = _probe_values(qmap)
    assert torch.equal(qm.encode(x, qmap), _brute_nearest(x, qmap))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # beta = 0: log(0) in the interpreter
def test_kernel_encode_equals_brute_force(device, backend):
    """Inside the op (native: table-driven encode): with beta1 = beta2 = 0 and a fresh state the
    new moments are exactly g and g*g, so the stored codes must be the nearest codes of
    g * (1/absmax), and the sign rule applied to negative values that round to 0."""
    n_thr = 1 if backend == "triton" else 4  # the interpreter is slow
    s = qm.signed_map()
    # Blocks of 256 whose absmax is exactly 1: x = g exactly.
    x = _probe_values(s)
    x = x[(x.abs() <= 1)][: 255 * 40 * n_thr]
    x = torch.cat([x, -torch.rand(255 * 2) * 1e-7])  # tiny negatives: 0 -> code 126
    nb = -(-x.numel() // 255)
    x = torch.nn.functional.pad(x, (0, nb * 255 - x.numel()))
    g = torch.cat([torch.ones(nb, 1), x.view(nb, 255)], dim=1).reshape(-1)
    g = g[torch.randperm(g.numel())].contiguous()  # absmax stays 1 only per block: re-block
    g = g.view(nb, 256)
    g[:, 0] = 1.0
    g = g.reshape(-1).to(device)
    n = g.numel()
    p = torch.zeros(n, device=device)
    c1 = torch.full((n,), 127, dtype=torch.uint8, device=device)
    c2 = torch.zeros(n, dtype=torch.uint8, device=device)
    a1 = torch.zeros(nb, device=device)
    a2 = torch.zeros(nb, device=device)
    step = torch.zeros((), device=device)
    ops.adam8bit_step_([p], [g], [c1], [c2], [a1], [a2], [], [step], s.to(device),
                       qm.unsigned_map(device), block_size=256, lr=0.0, lr_tensor=None, beta1=0.0,
                       beta2=0.0, eps=1e-8, weight_decay=0.0, maximize=False, decoupled=True,
                       master_mode=0, backend=backend)
    gc = g.cpu()
    assert torch.equal(a1.cpu(), torch.ones(nb))
    m = torch.zeros_like(gc) + (gc - torch.zeros_like(gc))  # the kernel's m (-0.0 becomes +0)
    want1 = _brute_nearest(m, s)
    want1 = torch.where(torch.signbit(m) & (want1 == 127), want1 - 1, want1)
    assert torch.equal(c1.cpu().long(), want1)
    assert int((c1.cpu() == 126).sum()) >= 2 * 255  # the sign rule fired
    v = gc * gc
    a2w = v.view(nb, 256).amax(dim=1)
    assert torch.equal(a2.cpu(), a2w)
    xv = v * qm.inv_scale(a2w).repeat_interleave(256)
    assert torch.equal(c2.cpu().long(), _brute_nearest(xv, qm.unsigned_map()))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # beta = 1: p becomes NaN (unused)
def test_kernel_roundtrip_of_exact_codes_is_exact(device, backend):
    """beta1 = beta2 = 1 leaves the moments unchanged; every block holds a +-1 code, so
    requantizing the dequantized state must give back the same codes and absmax."""
    n, block = (1024, 256) if backend == "triton" else (8192, 256)
    nb = n // block
    c1 = torch.randint(0, 256, (n,), dtype=torch.uint8)
    c2 = torch.randint(0, 256, (n,), dtype=torch.uint8)
    c1[::block] = 255
    c2[::block] = 255
    a1 = torch.rand(nb) * 1e-2 + 1e-6
    a2 = torch.rand(nb) * 1e-4 + 1e-9
    c1d, c2d, a1d, a2d = (t.clone().to(device) for t in (c1, c2, a1, a2))
    p = torch.zeros(n, device=device)
    ops.adam8bit_step_([p], [torch.zeros(n, device=device)], [c1d], [c2d], [a1d], [a2d], [],
                       [torch.zeros((), device=device)], qm.signed_map(device),
                       qm.unsigned_map(device), block_size=block, lr=0.0, lr_tensor=None, beta1=1.0,
                       beta2=1.0, eps=1e-8, weight_decay=0.0, maximize=False,
                       decoupled=True, master_mode=0, backend=backend)
    assert torch.equal(c1d.cpu(), c1) and torch.equal(c2d.cpu(), c2)
    assert torch.equal(a1d.cpu(), a1) and torch.equal(a2d.cpu(), a2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN arithmetic in the reference
def test_nan_moment_poisons_its_block(device, backend):
    """A NaN grad without found_inf (bf16 training has no scaler): its block's new absmax is NaN on
    every backend, as the reference's amax, and the other blocks are untouched by it."""
    n, block = 1024, 256
    g = torch.randn(n)
    g[300] = float("nan")  # block 1
    outs = []
    for be in (backend, "reference"):
        p = torch.zeros(n, device=device)
        c1 = torch.full((n,), 127, dtype=torch.uint8, device=device)
        c2 = torch.zeros(n, dtype=torch.uint8, device=device)
        a1 = torch.zeros(n // block, device=device)
        a2 = torch.zeros(n // block, device=device)
        ops.adam8bit_step_([p], [g.to(device)], [c1], [c2], [a1], [a2], [],
                           [torch.zeros((), device=device)], qm.signed_map(device),
                           qm.unsigned_map(device), block_size=block, lr=1e-3, lr_tensor=None,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           maximize=False, decoupled=True, master_mode=0, backend=be)
        outs.append([t.cpu() for t in (a1, a2, c1, c2)])
    for got, want in zip(*outs):
        assert torch.equal(got.isnan(), want.isnan())
    a1, a2 = outs[0][:2]
    assert a1.isnan().tolist() == [False, True, False, False] == a2.isnan().tolist()
    for got, want in zip(outs[0][2:], outs[1][2:]):  # codes outside the NaN block
        assert torch.equal(got[:block], want[:block])
        assert torch.equal(got[2 * block:], want[2 * block:])


@pytest.mark.parametrize("block", [256, 4096])
def test_quantization_error_within_bitsandbytes_bounds(block):
    # bitsandbytes test_dynamic_blockwise_quantization: randn with the signed map, rand[0,1)
    # with the unsigned map.
    a = torch.randn(1024, 1024)
    codes, absmax = qm.quantize_blockwise(a, qm.signed_map(), block)
    b = qm.dequantize_blockwise(codes, absmax, qm.signed_map(), block)
    diff = (a - b).abs()
    assert diff.mean().item() < 0.011
    assert (diff / (a.abs() + 1e-8)).mean().item() < 0.018
    a = torch.rand(1024, 1024)
    codes, absmax = qm.quantize_blockwise(a, qm.unsigned_map(), block)
    b = qm.dequantize_blockwise(codes, absmax, qm.unsigned_map(), block)
    diff = (a - b).abs()
    assert diff.mean().item() < 0.0023
    assert (diff / (a.abs() + 1e-8)).mean().item() < 0.012


def test_codec_layout_zero_blocks_and_partial_block():
    x = torch.zeros(3 * 256 + 5)
    x[256:512] = torch.randn(256)
    x[-5:] = torch.tensor([-3.0, 1.0, 0.5, -0.0, 2.0])
    codes, absmax = qm.quantize_blockwise(x, qm.signed_map(), 256)
    assert absmax.shape == (4,) and absmax[0].item() == 0 and absmax[-1].item() == 3.0
    assert bool((codes[:256] == 127).all())  # zeros encode as exact zero
    y = qm.dequantize_blockwise(codes, absmax, qm.signed_map(), 256)
    assert torch.equal(y[:256], torch.zeros(256)) and y[-5].item() == (3.0 * qm.signed_map()[0]).item()


@pytest.mark.parametrize("dtype,mode", [(torch.float32, 0), (torch.bfloat16, 1), (torch.bfloat16, 2)])
def test_opcheck_adam8bit_step(dtype, mode):
    """Schema, fake kernel and aot dispatch of adam8bit_step_ on CPU (every op passes opcheck)."""
    from mpfused.ops import OPS
    from mpfused.quant_maps import signed_map, unsigned_map

    n = 300
    p = [torch.randn(n).to(dtype)]
    g = [torch.randn(n).to(dtype)]
    codes1 = [torch.full((n,), 127, dtype=torch.uint8)]
    codes2 = [torch.zeros(n, dtype=torch.uint8)]
    nb = (n + 255) // 256
    a1, a2 = [torch.zeros(nb)], [torch.zeros(nb)]
    masters = ([p[0].float()] if mode == 1 else
               [torch.zeros(n, dtype=torch.int16)] if mode == 2 else [])
    args = (p, g, codes1, codes2, a1, a2, masters, [torch.zeros(())],
            signed_map(torch.device("cpu")), unsigned_map(torch.device("cpu")))
    kwargs = dict(block_size=256, lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, maximize=False, decoupled=True, master_mode=mode,
                  grad_scale=torch.tensor(2.0), found_inf=torch.zeros(()), norm_sq=None,
                  max_grad_norm=0.0, seed=0)
    torch.library.opcheck(OPS["adam8bit_step_"].overload, args, kwargs)
