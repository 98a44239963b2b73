"""A small driver that runs every CUDA op once (native and Triton backends) on small, odd-sized,
mixed-dtype inputs: the workload for compute-sanitizer (memcheck, racecheck) in gpu_suite.sh."""
import torch

import mpfused  # noqa: F401
from mpfused import quant_maps as qm
from mpfused.ops import OPS


def tensors(dtype, sizes=(1, 7, 4097, 65537)):
    return [torch.randn(n, device="cuda").to(dtype) for n in sizes]


def run(backend: str) -> None:
    dev = "cuda"
    grads = [g for dt in (torch.float32, torch.float16, torch.bfloat16) for g in tensors(dt)]
    grads.append(torch.randn(33, 17, device=dev).t())
    found, inv = torch.zeros((), device=dev), torch.tensor(0.5, device=dev)
    norm, per = torch.zeros((), device=dev), torch.zeros(len(grads), device=dev)
    OPS["unscale_grads_"](grads, found, inv, norm, per, backend=backend)
    OPS["check_grads"](grads, found, inv, norm, per, backend=backend)
    scale = torch.full((), 4.0, device=dev)
    gt = torch.zeros((), dtype=torch.int32, device=dev)
    ht = torch.ones((), dtype=torch.int32, device=dev)
    OPS["update_scale_"](scale, gt, ht, found, 2.0, 0.5, 2, 1, 0.0, float("inf"), backend=backend)
    for dtype, modes in ((torch.float32, (0,)), (torch.float16, (0, 1)), (torch.bfloat16, (0, 1, 2, 3))):
        for mode in modes:
            p = tensors(dtype)
            g = [torch.randn_like(x) for x in p]
            m = [torch.zeros_like(x, dtype=torch.float32) for x in p]
            v = [torch.zeros_like(x, dtype=torch.float32) for x in p]
            vmax = [torch.zeros_like(x, dtype=torch.float32) for x in p]
            masters = ([x.float() for x in p] if mode == 1 else
                       [torch.zeros_like(x, dtype=torch.int16) for x in p] if mode == 2 else [])
            steps = [torch.zeros((), device=dev) for _ in p]
            OPS["adam_step_"](p, g, m, v, vmax, masters, steps, 1e-3, None, 0.9, 0.999, 1e-8, 0.01,
                              True, False, True, mode, scale, found, norm, 1.0, 7, backend=backend)
    # 8-bit Adam: every block size class (within a warp, one warp, several warps, a whole 4096
    # chunk), odd sizes (tails, partial chunks), a misaligned and a transposed (staged) tensor.
    q1, q2 = qm.signed_map(dev), qm.unsigned_map(dev)
    for block in (64, 128, 256, 4096):
        for dtype, modes in ((torch.float32, (0,)), (torch.float16, (0, 1)),
                             (torch.bfloat16, (0, 1, 2, 3))):
            for mode in modes:
                p = tensors(dtype, sizes=(1, 7, 4097, 65537))
                p.append(torch.randn(4098, device=dev).to(dtype)[1:])  # 1 element past aligned
                p.append(torch.randn(33, 17, device=dev).to(dtype).t())
                g = [torch.randn_like(x) for x in p]
                m = [qm.quantize_blockwise(torch.randn(x.shape, device=dev) * 1e-3, q1, block)
                     for x in p]
                v = [qm.quantize_blockwise(torch.rand(x.shape, device=dev) * 1e-5, q2, block)
                     for x in p]
                masters = ([x.float() for x in p] if mode == 1 else
                           [torch.zeros_like(x, dtype=torch.int16) for x in p] if mode == 2 else [])
                steps = [torch.zeros((), device=dev) for _ in p]
                OPS["adam8bit_step_"](p, g, [c for c, _ in m], [c for c, _ in v],
                                      [a for _, a in m], [a for _, a in v], masters, steps, q1, q2,
                                      block, 1e-3, None, 0.9, 0.999, 1e-8, 0.01, False, True, mode,
                                      scale, found, norm, 1.0, 7, backend=backend)
    torch.cuda.synchronize()


if __name__ == "__main__":
    for b in ("native", "triton"):
        if b in OPS["adam_step_"].available("cuda"):
            run(b)
            print(f"{b}: ok")
