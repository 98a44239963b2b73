"""Hardening: non-finite storms, property-based tests against the reference, determinism,
no growth over many steps."""
import gc
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpfused
from mpfused.ops import OPS
from tests.conftest import DTYPES
from tests.tolerances import assert_close

OP_UNDER_TEST = "adam_step_"
# sizes around every boundary a kernel has: CPU chunk (32768), Triton block (4096), 8-bit block (256)
BOUNDARY_SIZES = [0, 1, 2, 3, 5, 7, 13, 255, 256, 257, 4095, 4096, 4097, 32767, 32768, 32769]


def expected_scale_trajectory(init, events, growth_interval, growth=2.0, backoff=0.5):
    scale, tracker, out = init, 0, []
    for bad in events:
        if bad:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                grown = float(torch.tensor(scale * growth, dtype=torch.float32))
                scale, tracker = (grown if math.isfinite(grown) else scale), 0
        out.append(scale)
    return out


@pytest.mark.parametrize("optim,master", [("AdamW", "fp32"), ("AdamW", "remainder"),
                                          ("AdamW8bit", "fp32")])
def test_non_finite_storm(one_thread, optim, master):
    """2000 steps with inf/NaN at random steps, tensors and positions (also the last element of an
    odd-sized tensor, also in one tensor of many): skipped steps change nothing, no NaN reaches a
    weight or a state, the scale follows the rule, training continues."""
    rng = random.Random(1234)
    shapes = [(31,), (17, 3), (1,), (257,), (5, 5, 5)] + [(rng.randint(1, 9),) for _ in range(40)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    params += [torch.nn.Parameter(torch.randn(13, 7)), torch.nn.Parameter(torch.randn(64, 81))]
    opt = getattr(mpfused, optim)(params, lr=1e-3, master_weights=master, max_grad_norm=5.0)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    events, scales = [], []
    for step in range(2000):
        for p in params:
            p.grad = torch.randn_like(p) * (scaler.get_scale() * 1e-2)
        bad = rng.random() < 0.15
        if bad:
            victim = rng.choice(params)
            where = rng.choice([0, victim.numel() - 1, rng.randrange(victim.numel())])
            victim.grad.view(-1)[where] = rng.choice([float("inf"), float("-inf"), float("nan")])
            snapshot = ([p.detach().clone() for p in params],
                        [{k: v.clone() for k, v in opt.state[p].items()} for p in params])
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        events.append(bad)
        scales.append(scaler.get_scale())
        if bad and step > 0:
            for p, old, st_old in zip(params, *snapshot):
                assert torch.equal(p.detach().view(torch.uint8), old.view(torch.uint8))
                for k, v in opt.state[p].items():
                    assert torch.equal(v, st_old[k]), (step, k)
        if step % 100 == 0 or step == 1999:
            for p in params:
                assert torch.isfinite(p.detach().float()).all()
                assert all(torch.isfinite(v.float()).all() for v in opt.state[p].values())
    assert scales == expected_scale_trajectory(2.0**12, events, 3)
    taken = sum(1 for b in events if not b)
    assert opt.state[params[-1]]["step"].item() == taken


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_check_unscale_property(device, backend, data):
    n_tensors = data.draw(st.integers(1, 6))
    grads = []
    for _ in range(n_tensors):
        size = data.draw(st.sampled_from(BOUNDARY_SIZES if backend != "triton" else BOUNDARY_SIZES[:12]))
        dtype = data.draw(st.sampled_from(DTYPES))
        g = (torch.randn(size * 2 + 1, device=device) * 100).to(dtype)
        g = g[::2] if data.draw(st.booleans()) else g[:size]  # strided views too
        grads.append(g)
    if data.draw(st.booleans()):
        g = data.draw(st.sampled_from([g for g in grads if g.numel()] or [None]))
        if g is not None:
            g.view(-1)[data.draw(st.integers(0, g.numel() - 1))] = float("nan")
    inv = data.draw(st.sampled_from([1.0, 0.5, 2.0**-14, 3.0]))
    write = data.draw(st.booleans())
    op = "unscale_grads_" if write else "check_grads"
    expect = [g.clone() for g in grads]
    outs = []
    for gs, be in ((grads, backend), (expect, "reference")):
        found, norm = torch.zeros((), device=device), torch.zeros((), device=device)
        per = torch.zeros(len(gs), device=device)
        OPS[op](gs, found, torch.tensor(inv, device=device), norm_sq=norm, norm_sq_per_tensor=per,
                backend=be)
        outs.append((found, norm, per))
    assert outs[0][0].item() == outs[1][0].item()
    for g, e in zip(grads, expect):
        if torch.isfinite(e).all():
            assert_close(g, e)
    if outs[1][0].item() == 0:
        assert_close(outs[0][1], outs[1][1], dtype=torch.float32, rtol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_adam_step_property(device, backend, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    modes = {torch.float32: [0], torch.float16: [0, 1], torch.bfloat16: [0, 1, 2]}[dtype]
    mode = data.draw(st.sampled_from(modes))
    sizes = data.draw(st.lists(st.sampled_from(BOUNDARY_SIZES[:13]), min_size=1, max_size=4))
    hyper = dict(lr=data.draw(st.sampled_from([1e-3, 1e-1])),
                 wd=data.draw(st.sampled_from([0.0, 0.1])),
                 amsgrad=data.draw(st.booleans()), maximize=data.draw(st.booleans()),
                 decoupled=data.draw(st.booleans()))
    base = [torch.randn(n, device=device).to(dtype) for n in sizes]
    grads = [torch.randn_like(b) for b in base]
    results = []
    for be in (backend, "reference"):
        p = [b.clone() for b in base]
        m = [torch.zeros_like(b, dtype=torch.float32) for b in base]
        v = [torch.zeros_like(b, dtype=torch.float32) for b in base]
        vm = [torch.zeros_like(b, dtype=torch.float32) for b in base] if hyper["amsgrad"] else []
        ms = ([b.float() for b in base] if mode == 1 else
              [torch.zeros_like(b, dtype=torch.int16) for b in base] if mode == 2 else [])
        steps = [torch.zeros((), device=device) for _ in base]
        # 16-bit params without a master are re-rounded every step: a 1-ulp difference after the
        # first step moves the second one, so they get one step (an fp32 master gets two)
        n_steps = 2 if dtype == torch.float32 or mode in (1, 2) else 1
        for _ in range(n_steps):
            OPS["adam_step_"](p, grads, m, v, vm, ms, steps, lr=hyper["lr"], lr_tensor=None,
                              beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=hyper["wd"], amsgrad=hyper["amsgrad"],
                              maximize=hyper["maximize"], decoupled=hyper["decoupled"],
                              master_mode=mode, backend=be)
        results.append((p, m, v, steps))
    for a, b in zip(results[0][0], results[1][0]):
        assert_close(a, b, rtol=OP_TOL_PARAM[dtype], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert_close(a, b, dtype=torch.float32, rtol=1e-5, atol=1e-6)
    assert [s.item() for s in results[0][3]] == [float(n_steps)] * len(sizes)


# a 16-bit param may land one ulp apart after fp32 vs float64 math
OP_TOL_PARAM = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("optim", ["AdamW", "AdamW8bit"])
def test_deterministic_run_to_run(device, backend, optim):
    torch.manual_seed(0)
    base = [torch.randn(n, device=device) for n in (4097, 33, 32769 if backend != "triton" else 5)]
    outs = []
    for _ in range(2):
        p = [torch.nn.Parameter(b.clone().bfloat16()) for b in base]
        opt = getattr(mpfused, optim)(p, max_grad_norm=1.0, backend=backend)
        gen = torch.Generator(device=device).manual_seed(1)
        for _ in range(3):
            for q in p:
                q.grad = torch.randn(q.shape, generator=gen, device=device).bfloat16()
            opt.step()
        outs.append([q.detach().clone() for q in p] +
                    [v for q in p for v in opt.state[q].values()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_no_growth_over_10000_steps(one_thread):
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (3, 5, 7, 300)]
    opt = mpfused.AdamW(params)
    scaler = mpfused.GradScaler("cpu", growth_interval=100)
    for p in params:
        p.grad = torch.randn_like(p)

    def step():
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()

    step()
    plan = opt._plans[0]
    ptrs = [v.data_ptr() for p in params for v in opt.state[p].values()]
    gc.collect()
    n_objects = len(gc.get_objects())
    for _ in range(10_000):
        step()
    gc.collect()
    assert opt._plans[0] is plan  # cached lists reused, never rebuilt
    assert ptrs == [v.data_ptr() for p in params for v in opt.state[p].values()]
    assert len(gc.get_objects()) - n_objects < 100
    assert opt.state[params[0]]["step"].item() == 10_001
    assert math.isfinite(scaler.get_scale())


def test_plan_rebuilt_when_params_change():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = mpfused.AdamW(params)
    params[0].grad = torch.randn(4)
    opt.step()
    plan = opt._plans[0]
    params[1].grad = torch.randn(4)
    opt.step()
    assert opt._plans[0] is not plan and opt.state[params[1]]["step"].item() == 1
    params[2].grad = torch.randn(4)
    opt.step()
    plan = opt._plans[0]  # every param has a grad
    opt.step()
    assert opt._plans[0] is plan  # nothing changed: the plan is reused
    params[1].grad = None  # a grad dropped from an all-grads plan
    opt.step()
    assert opt._plans[0] is not plan and opt.state[params[1]]["step"].item() == 3  # not stepped
    assert opt.state[params[0]]["step"].item() == 5
    plan = opt._plans[0]
    swapped = torch.nn.Parameter(torch.randn(4))  # a param replaced in place in the group's list
    swapped.grad = torch.randn(4)
    opt.param_groups[0]["params"][1] = swapped
    opt.step()
    assert opt._plans[0] is not plan and opt.state[swapped]["step"].item() == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_adam8bit_step_property(device, backend, data):
    """adam8bit_step_ against its reference at quantization-block and chunk boundaries: codes
    equal but for rare exact-tie roundings, absmax and params within fp32 rounding."""
    from mpfused.quant_maps import signed_map, unsigned_map

    dtype = data.draw(st.sampled_from(DTYPES))
    mode = data.draw(st.sampled_from({torch.float32: [0], torch.float16: [0, 1],
                                      torch.bfloat16: [0, 1, 2]}[dtype]))
    block = data.draw(st.sampled_from([64, 256]))
    sizes = data.draw(st.lists(st.sampled_from([1, 63, 64, 65, 255, 256, 257, 4097]),
                               min_size=1, max_size=3))
    base = [torch.randn(n, device=device).to(dtype) for n in sizes]
    grads = [torch.randn_like(b) for b in base]
    q1, q2 = signed_map(torch.device(device)), unsigned_map(torch.device(device))
    # a non-trivial starting state (random codes and absmax), then one step: a one-code rounding
    # difference in a step would otherwise move every later update of that element
    codes1 = [torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device) for b in base]
    codes2 = [torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device) for b in base]
    absmax = [torch.rand((b.numel() + block - 1) // block, device=device) for b in base]
    outs = []
    for be in (backend, "reference"):
        p = [b.clone() for b in base]
        c1, c2 = [c.clone() for c in codes1], [c.clone() for c in codes2]
        a1, a2 = [a * 0.1 for a in absmax], [a * 0.01 for a in absmax]
        ms = ([b.float() for b in base] if mode == 1 else
              [torch.zeros_like(b, dtype=torch.int16) for b in base] if mode == 2 else [])
        steps = [torch.zeros((), device=device) for _ in base]
        OPS["adam8bit_step_"](p, grads, c1, c2, a1, a2, ms, steps, q1, q2, block_size=block,
                              lr=1e-2, lr_tensor=None,
                              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
                              decoupled=True, master_mode=mode, backend=be)
        outs.append((p, c1, c2, a1, a2))
    for a, b in zip(outs[0][0], outs[1][0]):
        assert_close(a, b, rtol=OP_TOL_PARAM[dtype], atol=1e-5)
    for k in (1, 2):
        for a, b in zip(outs[0][k], outs[1][k]):
            assert (a.int() - b.int()).abs().max().item() <= 1
            assert (a != b).sum().item() <= max(2, 0.01 * a.numel())
    # absmax = max |beta m_old + (1 - beta) x|: where the two terms cancel the result is tiny and
    # its fp32 rounding (e.g. of 1 - beta1 = 0.10000002) is relative to the terms, not to it.
    eps = torch.finfo(torch.float32).eps
    for k, old, beta, x in ((3, 0.1, 0.9, [g.float().abs() for g in grads]),
                            (4, 0.01, 0.999, [g.float() ** 2 for g in grads])):
        for a, b, am, xi in zip(outs[0][k], outs[1][k], absmax, x):
            terms = old * am.max().item() + (1 - beta) * xi.max().item()
            assert_close(a, b, dtype=torch.float32, rtol=3e-5, atol=8 * eps * terms)


def _mem_available_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.mark.skipif(_mem_available_gib() < 16, reason="needs ~13 GiB free for 2^31-element state")
@pytest.mark.skipif("native" not in OPS["adam8bit_step_"].available("cpu"), reason="no extension")
def test_64bit_indexing_adam8bit_cpu():
    """The 8-bit kernel on a param of 2^31 + 300 elements: elements past 2^31 (in the last,
    partial quantization block) get exactly the update they get in a small tensor."""
    from mpfused.quant_maps import signed_map, unsigned_map

    n, tail = 2**31 + 300, 300 + 256  # the last 556 elements: blocks past 2^31, the last partial
    cpu = torch.device("cpu")
    q1, q2 = signed_map(cpu), unsigned_map(cpu)
    vals = torch.randn(tail).bfloat16()
    grads_tail = torch.randn(tail).bfloat16()

    def run(size):
        p = torch.zeros(size, dtype=torch.bfloat16)
        g = torch.zeros(size, dtype=torch.bfloat16)
        p[-tail:], g[-tail:] = vals, grads_tail
        c1 = torch.full((size,), 127, dtype=torch.uint8)
        c2 = torch.zeros(size, dtype=torch.uint8)
        nb = (size + 255) // 256
        a1, a2 = torch.zeros(nb), torch.zeros(nb)
        OPS["adam8bit_step_"]([p], [g], [c1], [c2], [a1], [a2], [], [torch.zeros(())], q1, q2,
                              block_size=256, lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, maximize=False, decoupled=True,
                              master_mode=0,
                              backend="native")
        return p[-tail:].clone(), c1[-tail:].clone(), c2[-tail:].clone(), a1[-3:].clone()

    big = run(n)
    gc.collect()
    small = run(tail + 2 * 256 + (n - tail) % 256)  # same offset of the tail inside its blocks
    for a, b in zip(big, small):
        assert torch.equal(a, b)
