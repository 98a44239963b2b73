"""adam8bit_step_ on every backend against the float64 reference (found_inf skips bit for bit), and
every CPU ISA build of the 8-bit kernel bit-identical (moved from tests/test_adamw8bit.py)."""
import hashlib

import pytest
import torch

import mpfused
from mpfused import quant_maps as qm
from mpfused.ops import adam8bit as ops
from tests import isa_builds
from tests.tolerances import OP_TOL

OP_UNDER_TEST = "adam8bit_step_"
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2)


def _random_state(n, block, gen):
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    c1, a1 = qm.quantize_blockwise(m, qm.signed_map(), block)
    c2, a2 = qm.quantize_blockwise(v, qm.unsigned_map(), block)
    return c1, c2, a1, a2


# (param dtype, master mode): fp32; fp16 + fp32 master / none; bf16 + every mode
CASES = [(torch.float32, 0), (torch.float16, 1), (torch.float16, 0), (torch.bfloat16, 1),
         (torch.bfloat16, 2), (torch.bfloat16, 3), (torch.bfloat16, 0)]


@pytest.mark.parametrize("dtype,mode", CASES, ids=[f"{str(d)[6:]}-m{m}" for d, m in CASES])
def test_backends_agree_with_reference(device, backend, dtype, mode):
    sizes = [700, 256, 1, 0, 300]  # partial blocks, a 1-element tensor, an empty one
    block = 64 if backend == "triton" else 256
    gen = torch.Generator().manual_seed(1234)
    results = {}
    for name in (backend, "reference"):
        gen.manual_seed(1234)
        params, grads, c1s, c2s, a1s, a2s, masters, steps = ([] for _ in range(8))
        for n in sizes:
            p32 = torch.randn(n, generator=gen) * 0.1
            params.append(p32.to(dtype).to(device))
            grads.append((torch.randn(n, generator=gen) * 0.01).to(dtype).to(device))
            c1, c2, a1, a2 = _random_state(n, block, gen)
            c1s.append(c1.to(device)), c2s.append(c2.to(device))
            a1s.append(a1.to(device)), a2s.append(a2.to(device))
            if mode == 1:
                masters.append((p32 + 1e-5).to(device))
            elif mode == 2:
                masters.append(torch.randint(-2**15, 2**15, (n,), generator=gen,
                                             dtype=torch.int16).to(device))
            steps.append(torch.full((), 4.0, device=device))
        h = HYPER
        ops.adam8bit_step_(params, grads, c1s, c2s, a1s, a2s, masters, steps,
                           qm.signed_map(device), qm.unsigned_map(device), block_size=block,
                           lr=h["lr"], lr_tensor=None,
                           beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["wd"],
                           maximize=False, decoupled=True, master_mode=mode,
                           grad_scale=torch.tensor(2.0, device=device), found_inf=torch.tensor(0.0,
                                                                                               device=device),
                           norm_sq=torch.tensor(4.0, device=device), max_grad_norm=1.0, seed=7,
                           backend=name)
        results[name] = (params, c1s, c2s, a1s, a2s, masters, steps)
    got, ref = results[backend], results["reference"]
    rtol, atol = OP_TOL[dtype]
    for i in range(len(sizes)):
        torch.testing.assert_close(got[0][i].float(), ref[0][i].float(), rtol=rtol, atol=atol)
        for k in (1, 2):  # codes: equal except where a moment is within rounding of a threshold
            diff = (got[k][i].int() - ref[k][i].int()).abs()
            assert int((diff > 1).sum()) == 0 and int((diff > 0).sum()) <= 2
        for k in (3, 4):
            torch.testing.assert_close(got[k][i], ref[k][i], rtol=1e-6, atol=0)
        if mode == 1:
            torch.testing.assert_close(got[5][i], ref[5][i], rtol=1e-6, atol=1e-9)
        assert got[6][i].item() == ref[6][i].item() == 5.0


def test_found_inf_skips_everything_bit_identical(device, backend):
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    c1, c2, a1, a2 = (t.to(device) for t in _random_state(n, 256, gen))
    master = p.float() + 1e-4
    step = torch.full((), 3.0, device=device)
    before = [t.clone() for t in (p, c1, c2, a1, a2, master, step)]
    g = torch.full((n,), float("inf"), dtype=torch.bfloat16, device=device)
    ops.adam8bit_step_([p], [g], [c1], [c2], [a1], [a2], [master], [step], qm.signed_map(device),
                       qm.unsigned_map(device), block_size=256, lr=1e-3, lr_tensor=None, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
                       decoupled=True, master_mode=1, grad_scale=torch.tensor(65536.0,
                                                                              device=device),
                       found_inf=torch.tensor(1.0, device=device), norm_sq=None, max_grad_norm=0.0,
                       seed=0, backend=backend)
    for a, b in zip((p, c1, c2, a1, a2, master, step), before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)


def isa_digest(seed: int) -> str:
    """The bytes every dtype / master mode of the native 8-bit kernel writes (tests/isa_builds.py
    runs it once per ISA build)."""
    gen = torch.Generator().manual_seed(seed)
    h = hashlib.sha256()
    # every dtype / master mode; sizes with partial tiles and blocks, and a multi-chunk tensor
    for dtype, mode in [(torch.float32, 0), (torch.float16, 1), (torch.bfloat16, 2), (torch.bfloat16, 3)]:
        sizes = [1, 63, 64, 65, 1000, 70001]
        ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
        c1s, c2s, a1s, a2s = [], [], [], []
        for n in sizes:
            c1, a1 = qm.quantize_blockwise(torch.randn(n, generator=gen) * 1e-3, qm.signed_map(), 256)
            c2, a2 = qm.quantize_blockwise(torch.rand(n, generator=gen) * 1e-5, qm.unsigned_map(), 256)
            c1s.append(c1), c2s.append(c2), a1s.append(a1), a2s.append(a2)
        masters = ([p.float() + 1e-5 for p in ps] if mode == 1 else
                   [torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int16) for n in sizes]
                   if mode == 2 else [])
        steps = [torch.zeros(()) for _ in sizes]
        for _ in range(3):
            grads = [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for n in sizes]
            ops.adam8bit_step_(ps, grads, c1s, c2s, a1s, a2s, masters, steps, qm.signed_map(),
                               qm.unsigned_map(), block_size=256, lr=1e-3, lr_tensor=None, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False,
                               decoupled=True, master_mode=mode, backend="native")
        for t in ps + c1s + c2s + a1s + a2s + masters:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.skipif(not mpfused.ops.OPS[OP_UNDER_TEST].native_available("cpu"),
                    reason="no native extension")
def test_every_cpu_isa_build_is_bit_identical():
    """The 8-bit CPU kernel is built per ISA (baseline, x86-64-v3, v4, v4 + VBMI byte-permute
    decode); MPFUSED_CPU_ISA caps the one picked. Every build must give the same bytes."""
    digests = isa_builds.digests("adam8bit")
    assert len(set(digests.values())) == 1, digests
