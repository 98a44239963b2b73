"""The cases of the GPU smoke test (gpu_smoke.py) and of the compute-sanitizer workload
(sanitizer_driver.py): every op family x param dtype x mode, on CPU inputs that the runners copy
to the device with their layout kept (odd sizes, a tensor one element past an aligned start, a
transposed one).

A case is (op, backend, dtype, mode). `mode` is the master mode (none / fp32-master / remainder /
stochastic / remainder8), for SGD prefixed by the momentum variant (`plain/`, `momentum/`, `nesterov/`; the
8-bit and 4-bit SGD have no plain variant: the buffer is their only state). `inputs()` gives the op's
arguments in schema order and the tensors it writes, in the order params, state..., masters,
steps (gpu_smoke's remainder join relies on it).
"""
from __future__ import annotations

FAMILIES = ("check_grads", "unscale_grads_", "update_scale_", "adam_step_", "adam8bit_step_",
            "adam4bit_step_", "sgd_step_", "lion_step_", "sgd8bit_step_", "lion8bit_step_",
            "sgd4bit_step_", "lion4bit_step_")
# the families whose native CUDA and Triton kernels run the CPU kernel's math to the bit (same
# per-element functions, no reduction): gpu_smoke requires bit equality with the CPU kernel
EXACT_FAMILIES = ("sgd_step_", "lion_step_", "sgd8bit_step_", "lion8bit_step_", "sgd4bit_step_",
                  "lion4bit_step_")
DTYPES = ("fp32", "fp16", "bf16")
MODES = {0: "none", 1: "fp32-master", 2: "remainder", 3: "stochastic", 4: "remainder8"}
# the master modes each param dtype has (remainders and stochastic rounding are bf16's)
DTYPE_MODES = {"fp32": (0,), "fp16": (0, 1), "bf16": (0, 1, 2, 3, 4)}
SGD_VARIANTS = {"sgd_step_": ("plain", "momentum", "nesterov"),
                "sgd8bit_step_": ("momentum", "nesterov"), "sgd4bit_step_": ("momentum", "nesterov")}


def cases(backends: list[str]) -> list[tuple]:
    out = []
    for b in backends:
        for op in FAMILIES:
            if op in ("check_grads", "unscale_grads_"):
                out += [(op, b, dt, "-") for dt in DTYPES]
            elif op == "update_scale_":
                out.append((op, b, "fp32", "-"))
            else:
                masters = [(dt, MODES[m]) for dt in DTYPES for m in DTYPE_MODES[dt]]
                if op in SGD_VARIANTS:
                    out += [(op, b, dt, f"{v}/{m}") for v in SGD_VARIANTS[op] for dt, m in masters]
                else:
                    out += [(op, b, dt, m) for dt, m in masters]
    return out


def master_code(mode: str) -> int:
    return {v: k for k, v in MODES.items()}[mode.split("/")[-1]]


def inputs(op: str, dtype_name: str, mode: str, gen, block: int = 256, count: int = 0,
           found_inf: float = 0.0):
    """CPU inputs for one case: odd sizes, a tensor one element past an aligned start (offset
    view) and a transposed one (or, with count > 0, that many 1..7-element tensors: several
    launches of a multi-tensor kernel); returns (args, kwargs, outputs) with the outputs the op
    writes. found_inf > 0: the skipped step (nothing may be written)."""
    import torch
    from mpfused import quant_maps as qm

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]

    def shaped():
        if count:
            return [torch.randn(1 + i % 7, generator=gen).to(dtype) for i in range(count)]
        ts = [torch.randn(n, generator=gen).to(dtype) for n in (1, 7, 4097, 65537)]
        ts.append(torch.randn(4098, generator=gen).to(dtype)[1:])        # offset view
        ts.append(torch.randn(33, 17, generator=gen).to(dtype).t())      # transposed view
        return ts

    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    if op in ("check_grads", "unscale_grads_"):
        grads = shaped()
        if op == "check_grads":
            grads[min(2, len(grads) - 1)].view(-1)[-1] = float("inf")
        found, inv = f32(0.0), f32(0.5)
        norm, per = f32(0.0), torch.zeros(len(grads))
        return [grads, found, inv], dict(norm_sq=norm, norm_sq_per_tensor=per), (
            [found, norm, per] + (grads if op == "unscale_grads_" else []))
    if op == "update_scale_":
        scale, gt, ht = f32(4.0), torch.tensor(3, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
        found = f32(1.0)
        return [scale, gt, ht, found], dict(
            growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=1, min_scale=0.0,
            max_scale=float("inf")), [scale, gt, ht]
    m = master_code(mode)
    p = shaped()
    g = [torch.randn(x.shape, generator=gen).to(dtype) for x in p]
    masters = ([x.float() for x in p] if m == 1 else
               [torch.zeros(x.shape, dtype=torch.int16) for x in p] if m == 2 else
               [torch.zeros(x.shape, dtype=torch.int8) for x in p] if m == 4 else [])
    # SGD: the second tensor takes its first step (step 0: its buffer becomes the gradient)
    steps = [f32(0.0 if i == 1 and op.startswith("sgd") else 3.0) for i in range(len(p))]
    # unscale by 2 and clip: norm_sq 4 with max_grad_norm 1 halves the grads (the fused paths)
    scale, found, norm = f32(2.0), f32(found_inf), f32(4.0)
    tail = dict(master_mode=m, grad_scale=scale, found_inf=found, norm_sq=norm, max_grad_norm=1.0,
                seed=7)
    state = lambda: [torch.randn(x.shape, generator=gen) * 1e-3 for x in p]  # noqa: E731
    if op == "adam_step_":
        ms = state()
        vs = [torch.rand(x.shape, generator=gen) * 1e-5 for x in p]
        vmax = [v.clone() for v in vs]
        args = [p, g, ms, vs, vmax, masters, steps]
        hyper = dict(lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                     amsgrad=True, maximize=False, decoupled=True)
        return args, {**hyper, **tail}, p + ms + vs + vmax + masters + steps
    variant = mode.split("/")[0] if "/" in mode else None
    momentum = 0.0 if variant == "plain" else 0.9
    dampening = 0.1 if variant == "momentum" else 0.0  # Nesterov needs dampening 0
    if op == "sgd_step_":
        bufs = state() if momentum else []
        hyper = dict(lr=1e-3, lr_tensor=None, momentum=momentum, dampening=dampening,
                     weight_decay=0.01, nesterov=variant == "nesterov", maximize=False)
        return [p, g, bufs, masters, steps], {**hyper, **tail}, p + bufs + masters + steps
    if op == "lion_step_":
        ms = state()
        hyper = dict(lr=1e-4, lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=0.01,
                     maximize=False)
        return [p, g, ms, masters, steps], {**hyper, **tail}, p + ms + masters + steps
    q1 = qm.signed_map("cpu")
    if op in ("sgd8bit_step_", "lion8bit_step_", "sgd4bit_step_", "lion4bit_step_"):
        quantize = qm.quantize_blockwise
        if op.endswith("4bit_step_"):  # torchao's 16-entry signed map, packed codes
            from mpfused import quant4
            q1, quantize = quant4.signed4_map("cpu"), quant4.quantize4_blockwise
        cq = [quantize(s, q1, block) for s in state()]
        codes, absmax = [c for c, _ in cq], [a for _, a in cq]
        head = [p, g, codes, absmax, masters, steps, q1]
        if op.startswith("sgd"):
            hyper = dict(lr=1e-3, lr_tensor=None, momentum=momentum, dampening=dampening,
                         weight_decay=0.01, nesterov=variant == "nesterov", maximize=False)
        else:
            hyper = dict(lr=1e-4, lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=0.01,
                         maximize=False)
        return head, {"block_size": block, **hyper, **tail}, p + codes + absmax + masters + steps
    # adam8bit_step_ / adam4bit_step_ (one schema; 4-bit: torchao's 16-entry maps, packed codes)
    q2 = qm.unsigned_map("cpu")
    quantize = qm.quantize_blockwise
    if op == "adam4bit_step_":
        from mpfused import quant4
        q1, q2, quantize = quant4.signed4_map("cpu"), quant4.unsigned4_map("cpu"), quant4.quantize4_blockwise
    mq = [quantize(s, q1, block) for s in state()]
    vq = [quantize(torch.rand(x.shape, generator=gen) * 1e-5, q2, block) for x in p]
    c1, a1 = [c for c, _ in mq], [a for _, a in mq]
    c2, a2 = [c for c, _ in vq], [a for _, a in vq]
    hyper = dict(block_size=block, lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.01, maximize=False, decoupled=True)
    return ([p, g, c1, c2, a1, a2, masters, steps, q1, q2], {**hyper, **tail},
            p + c1 + c2 + a1 + a2 + masters + steps)
