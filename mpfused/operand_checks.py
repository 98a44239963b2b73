"""The ops' operand rules, stated once in Python: the native bindings' (csrc/bindings/common.h,
quant8_args.h: the kernels' contract, which the bindings keep checking in C++) for every family.

Two callers. The fake (meta) kernels check list lengths, dtypes and devices with ``torch._check``,
so a ``torch.compile`` / fake-mode call with a wrong operand fails at trace time with an error
that names the op and the argument ("mpfused: adam_step_: exp_avgs[3] has dtype torch.float16,
expected torch.float32 (exp_avgs[3] must be torch.float32 with params[3]'s 10 elements)"). The
Triton launchers (and the block-wise references' run-time rules) call the same functions with
``values=True``, which adds what only real tensors show: sizes (numels, codes per block size),
1-element scalars, contiguity, sparse layouts, the block size, the maps' length and order and
the 8-bit signed map's +0 (check_signed_map). Outside tracing ``torch._check`` raises a plain
RuntimeError, so either way the error names the op, the argument and the rule, before anything
is written. Cheap: one pass over each list; no tensor is read but the maps, once per version
(the cache the launchers' thresholds read them through anyway).
"""
from __future__ import annotations

import torch

from mpfused.master_modes import MASTER_DTYPE, REMAINDER8, kernel_mode
from mpfused.quant4 import codes4_numel
from mpfused.quant_maps import BLOCK_SIZES, is_sorted, zero_code

F32 = torch.float32
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def fail(op: str, message: str) -> None:
    torch._check(False, lambda: f"mpfused: {op}: {message}")


def _values(op: str, label: str, t, rule, numel=None, contiguous: bool = False) -> None:
    """The run-time rules of one tensor: dense layout, ``numel`` elements, contiguity."""
    if t.layout != torch.strided:
        fail(op, f"{label} is sparse; mpfused optimizers support dense tensors only")
    if (numel is not None and t.numel() != numel) or (contiguous and not t.is_contiguous()):
        fail(op, f"{label} {rule}, got {list(t.shape)} {t.dtype}"
                 f"{'' if t.is_contiguous() else ' (non-contiguous)'}")


def check_tensor(op: str, name: str, t, dev, dtype=F32, *, cpu_ok: bool = False, rule=None,
                 numel=None, contiguous: bool = False, values: bool = False,
                 anchor: str = "the params' device") -> None:
    """A tensor operand or optional scalar tensor (None passes): ``dtype`` (None: any) on ``dev``
    (or on the CPU when ``cpu_ok``); with ``values``, ``numel`` elements (and contiguous).
    ``rule``: the rule in words after the name ("must be a 1-element float32 tensor on cpu")."""
    if t is None:
        return
    why = f" ({name} {rule})" if rule else ""
    if dtype is not None and t.dtype != dtype:
        fail(op, f"{name} has dtype {t.dtype}, expected {dtype}{why}")
    if t.device != dev and not (cpu_ok and t.device.type == "cpu"):
        fail(op, f"{name} is on {t.device}, expected {dev} ({anchor}"
                 f"{' or the CPU' if cpu_ok else ''})")
    if values:
        _values(op, name, t, rule, numel, contiguous)


def check_list(op: str, name: str, tensors, n: int, dev, dtype=None, *, like=None,
               optional: bool = False, why: str = "one per param", rule=None, numel=None,
               contiguous: bool = False, values: bool = False) -> None:
    """``tensors`` has n tensors (or none when ``optional``; ``why``: the reason, for the
    message), each on ``dev`` with ``dtype`` (``like``: the dtype of like[i]); with ``values``,
    numel(i) elements (None: any) and contiguous when asked. ``rule(i)``: the rule in words after
    "name[i]", for the message."""
    if len(tensors) != n and not (optional and len(tensors) == 0):
        fail(op, f"{name} has {len(tensors)} tensors, expected {n} ({why}"
                 f"{', or none' if optional else ''})")
    for i, t in enumerate(tensors):
        label = f"{name}[{i}]"
        want = like[i].dtype if like is not None else dtype
        if want is not None and t.dtype != want:
            fail(op, f"{label} has dtype {t.dtype}, expected {want}"
                     f"{f' ({label} {rule(i)})' if rule else ''}")
        if t.device != dev:
            fail(op, f"{label} is on {t.device}, expected {dev} (the params' device)")
        if values:
            _values(op, label, t, rule(i) if rule else None,
                    numel(i) if numel is not None else None, contiguous)


def check_block_size(op: str, block_size) -> None:
    """A block-wise op's block size (a ValueError, as the optimizers' own check)."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"mpfused: {op}: block_size must be a power of two in "
                         f"[{BLOCK_SIZES[0]}, {BLOCK_SIZES[-1]}], got {block_size}")


def codes_numel(numel: int, bits: int) -> int:
    """Code bytes of a tensor of ``numel`` elements: one per element, or two 4-bit codes a byte."""
    return numel if bits == 8 else codes4_numel(numel)


def check_codes(op: str, name: str, codes, params, dev, bits: int = 8, *,
                values: bool = False) -> None:
    """Block-wise state codes: one uint8 tensor per param, contiguous, codes_numel bytes."""
    def rule(i):
        k = codes_numel(params[i].numel(), bits)
        if bits == 8:
            return f"must be contiguous uint8 codes, one per element of params[{i}] ({k})"
        return f"must be contiguous uint8 with ceil(numel / 2) = {k} bytes (two 4-bit codes each)"
    check_list(op, name, codes, len(params), dev, torch.uint8, rule=rule, contiguous=True,
               numel=lambda i: codes_numel(params[i].numel(), bits), values=values)


def check_qmap(op: str, name: str, qmap, dev, bits: int = 8, *, values: bool = False) -> None:
    """A quantization map: 2**bits contiguous float32 entries; with ``values``, strictly
    increasing too (read once per map version, in quant_maps' cache; the CPU bindings state it
    in C++, check_qmap_values, same message after the op's name)."""
    check_tensor(op, name, qmap, dev, rule=f"must be a contiguous float32 tensor of {1 << bits} "
                 "entries", numel=1 << bits, contiguous=True, values=values)
    if values and not is_sorted(qmap):
        fail(op, f"{name} must be strictly increasing (sorted)")


def check_signed_map(op: str, name: str, qmap) -> None:
    """The map of an 8-bit state under the sign rule (Adam's exp_avg, SGD's momentum buffer,
    Lion's moment) holds +0.0 above its lowest entry: a zero moment encodes exactly, and a
    negative value that rounds to +0 steps one code below it (bitsandbytes' rule). A value rule
    (values=True only): the map is read once per version, in quant_maps' cache that the Triton
    launchers' thresholds share. The CPU bindings state it in C++ (cpu_signed_map_zero_code, same
    message after the op's name), the CUDA kernels on the device (the prepare launch's validity
    flag). 4-bit codes have no sign rule (nearest code): their maps need no +0."""
    if zero_code(qmap) <= 0:
        fail(op, f"{name} must hold +0.0 above its lowest entry")


def check_step(op: str, params, grads, states, masters, steps, *, master_mode: int, lr_tensor,
               grad_scale, found_inf, norm_sq, param_ids, elem_offsets, codes=(), absmaxs=(),
               qmaps=(), block_size=None, bits: int = 8, values: bool = False,
               lr_on_device: bool = False) -> None:
    """The operands of a multi-tensor step op. ``states``: (name, tensors, required[, why]) of
    fp32 per-element state (an optional one may be empty; ``why``: the reason it is required);
    ``codes``: (name, tensors) of uint8 block codes of ``bits``; ``absmaxs``: (name, tensors) of
    fp32 per-block scales of ``block_size``; ``qmaps``: (name, tensor) fp32 maps. ``values``: the
    run-time rules too (see the module doc); ``lr_on_device``: a tensor lr on the params' device
    only (a kernel that reads it there)."""
    n = len(params)
    if n == 0:
        return
    dev = params[0].device
    for i, p in enumerate(params):
        if p.dtype not in FLOATS:
            fail(op, f"params[{i}] has dtype {p.dtype}, expected float32, float16 or bfloat16")
        if p.device != dev:
            fail(op, f"params[{i}] is on {p.device}, expected {dev} (params[0]'s device)")
        if values:
            _values(op, f"params[{i}]", p, None)

    def size(i):
        return params[i].numel()
    check_list(op, "grads", grads, n, dev, like=params,
               rule=lambda i: "must have its param's dtype and size", numel=size, values=values)
    for name, tensors, required, *why in states:
        check_list(op, name, tensors, n, dev, F32, optional=not required,
                   why=why[0] if why and required else "one per param", numel=size,
                   rule=lambda i: f"must be torch.float32 with params[{i}]'s {size(i)} elements",
                   values=values)
    if values and (codes or absmaxs):
        check_block_size(op, block_size)
    for name, tensors in codes:
        check_codes(op, name, tensors, params, dev, bits, values=values)

    def blocks(i):
        return -(-size(i) // block_size)
    for name, tensors in absmaxs:
        check_list(op, name, tensors, n, dev, F32, numel=blocks, contiguous=True, values=values,
                   rule=lambda i: "must be contiguous float32 with ceil(numel / block_size) = "
                                  f"{blocks(i)} entries")
    check_masters(op, params, masters, master_mode, dev, values=values)
    check_list(op, "steps", steps, n, dev, F32, numel=lambda i: 1, values=values,
               rule=lambda i: f"must be a 1-element float32 tensor on {dev}")
    for name, t in qmaps:
        check_qmap(op, name, t, dev, bits, values=values)
    check_tensor(op, "lr_tensor", lr_tensor, dev, None, cpu_ok=not lr_on_device, numel=1,
                 values=values, rule="must be a 1-element tensor")
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("norm_sq", norm_sq)):
        check_tensor(op, name, t, dev, numel=1, values=values,
                     rule=f"must be a 1-element float32 tensor on {dev}")
    for name, ids in (("param_ids", param_ids), ("elem_offsets", elem_offsets)):
        if len(ids) not in (0, n):
            fail(op, f"{name} has {len(ids)} entries, expected {n} (one per param) or none")


def check_masters(op: str, params, masters, master_mode, dev, *, values: bool = False) -> None:
    """adam_math.h's master modes (mpfused/master_modes.py): a known mode, remainder8 only for
    bfloat16 (or float32) params, masters of the mode's dtype, one per param when a param's
    dtype takes the mode (kernel_mode), each of its param's size."""
    mode = int(master_mode)
    if mode not in range(5):
        fail(op, f"master_mode must be 0 (none), 1 (fp32), 2 (remainder), 3 (stochastic) or 4 "
                 f"(remainder8), got {master_mode}")
    for i, p in enumerate(params):
        if mode == REMAINDER8 and p.dtype == torch.float16:
            fail(op, f"master_mode 4 (remainder8) needs bfloat16 (or float32) params: params[{i}] "
                     "is float16, which is not the top half of an fp32 word")
    kept = [kernel_mode(p.dtype, mode) in MASTER_DTYPE for p in params]
    want = MASTER_DTYPE.get(mode)
    check_list(op, "masters", masters, len(params), dev, want, optional=not any(kept),
               why=f"master_mode {mode} needs one master per param",
               rule=lambda i: f"must be {want} with params[{i}]'s {params[i].numel()} elements",
               numel=lambda i: params[i].numel() if kept[i] else None, values=values)


# ---- the operands of each step op: its fake kernel (fake_kernel) and, with values=True, its
# Triton launcher's check ---------------------------------------------------------------------
def _scalars(master_mode, lr_tensor, grad_scale=None, found_inf=None, norm_sq=None,
             param_ids=(), elem_offsets=(), values=False, **_hyper):
    return dict(master_mode=master_mode, lr_tensor=lr_tensor, grad_scale=grad_scale,
                found_inf=found_inf, norm_sq=norm_sq, param_ids=param_ids,
                elem_offsets=elem_offsets, values=values, lr_on_device=values)


def adam_operands(op, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, *,
                  amsgrad, **scalars) -> None:
    """adam_step_: fp32 moments, one max_exp_avg_sq per param with amsgrad."""
    check_step(op, params, grads,
               [("exp_avgs", exp_avgs, True), ("exp_avg_sqs", exp_avg_sqs, True),
                ("max_exp_avg_sqs", max_exp_avg_sqs, bool(amsgrad),
                 "amsgrad needs one max_exp_avg_sq per param")],
               masters, steps, **_scalars(**scalars))


def sgd_operands(op, params, grads, momentum_buffers, masters, steps, *, momentum,
                 **scalars) -> None:
    """sgd_step_: one fp32 momentum buffer per param when momentum != 0 (else none is read)."""
    check_step(op, params, grads,
               [("momentum_buffers", momentum_buffers, momentum != 0,
                 "momentum != 0 needs one momentum buffer per param")],
               masters, steps, **_scalars(**scalars))


def lion_operands(op, params, grads, exp_avgs, masters, steps, **scalars) -> None:
    """lion_step_: one fp32 moment per param."""
    check_step(op, params, grads, [("exp_avgs", exp_avgs, True)], masters, steps,
               **_scalars(**scalars))


def adam8bit_operands(op, params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters,
                      steps, qmap1, qmap2, *, block_size, bits=8, values=False,
                      **scalars) -> None:
    """adam8bit_step_ / adam4bit_step_ (``bits``): two code lists, their absmax, two maps (8-bit:
    qmap1 signed, check_signed_map)."""
    check_step(op, params, grads, (), masters, steps,
               codes=[("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)],
               absmaxs=[("absmax1s", absmax1s), ("absmax2s", absmax2s)],
               qmaps=[("qmap1 (signed map)", qmap1), ("qmap2 (unsigned map)", qmap2)],
               block_size=block_size, bits=bits, **_scalars(values=values, **scalars))
    if values and params and bits == 8:
        check_signed_map(op, "qmap1 (signed map)", qmap1)


def one_state_operands(op, state, params, grads, codes, absmaxs, masters, steps, qmap, *,
                       block_size, bits=8, values=False, **scalars) -> None:
    """A one-state block-wise op, ``(params, grads, <state>, absmaxs, masters, steps, qmap, *,
    block_size, ...)`` (sgd8bit_step_, lion8bit_step_ and their 4-bit ops): uint8 codes named
    ``state``, fp32 absmax, an fp32 map (8-bit: signed, check_signed_map)."""
    check_step(op, params, grads, (), masters, steps, codes=[(state, codes)],
               absmaxs=[("absmaxs", absmaxs)], qmaps=[("qmap (signed map)", qmap)],
               block_size=block_size, bits=bits, **_scalars(values=values, **scalars))
    if values and params and bits == 8:
        check_signed_map(op, "qmap (signed map)", qmap)


def check_quantized_momentum(op: str, momentum) -> None:
    """sgd8bit_step_ / sgd4bit_step_: the quantized state is the buffer, so plain SGD (momentum
    0) has none (bitsandbytes' SGD8bit too)."""
    if not momentum > 0:
        fail(op, f"momentum must be > 0, got {momentum}")


def fake_kernel(check, op: str, *args, **fixed):
    """The fake kernel of ``op``: its operand check (``check(op, *args, operands..., **fixed,
    scalars...)``), at trace time (values=False)."""
    def fake(*operands, **kwargs):
        check(op, *args, *operands, **fixed, **kwargs)
    return fake


def check_amp(op: str, grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, *,
              values: bool = False) -> None:
    """The operands of unscale_grads_ / check_grads: grads of a float dtype on found_inf's device,
    the scalars 1-element float32 there, norm_sq_per_tensor one float32 entry per grad."""
    dev = found_inf.device  # always given (grads may be empty)
    for i, g in enumerate(grads):
        if g.dtype not in FLOATS:
            fail(op, f"grads[{i}] has dtype {g.dtype}, expected float32, float16 or bfloat16")
        if g.device != dev:
            fail(op, f"grads[{i}] is on {g.device}, found_inf on {dev} (one device per call)")
        if values:
            _values(op, f"grads[{i}]", g, None)
    for name, t in (("found_inf", found_inf), ("inv_scale", inv_scale), ("norm_sq", norm_sq)):
        check_tensor(op, name, t, dev, numel=1, values=values, anchor="found_inf's device",
                     rule=f"must be a 1-element float32 tensor on {dev}")
    check_tensor(op, "norm_sq_per_tensor", norm_sq_per_tensor, dev, numel=len(grads),
                 contiguous=True, values=values, anchor="found_inf's device",
                 rule=f"must be a contiguous float32 tensor of len(grads) = {len(grads)} entries")
