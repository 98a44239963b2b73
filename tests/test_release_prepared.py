"""Gradient release's prepared calls (issue 23, release step time on CPU): at the backward's first
grad each release bucket's whole update is made ready as one native call (``chunk.call``,
``_release_update.BucketUpdate._prepare_calls``); a bucket released whole then makes that call
instead of going through ``_update``. These tests pin that it computes exactly what ``_update``
does when the options change between steps (LR scheduler, weight decay, betas, maximize, the
loss scale), with non-finite grads and a scaler, and that it steps aside where the prepared call
would be stale or wrong: a write to the optimizer state inside the backward, a bucket released
in part, a backward with create_graph=True."""
import collections
import math

import pytest
import torch

import mpfused
from mpfused.ops import OPS
from mpfused.optim._release_update import _brought_to
from mpfused.optim.release import GradRelease
from tests.test_release import _finish_step, _inject_hooks, _model, _snapshot

pytestmark = pytest.mark.skipif(not OPS["adam_step_"].native_available("cpu"),
                                reason="prepared calls serve the native kernels only")

CASES = {
    "AdamW-bf16-master": (mpfused.AdamW, torch.bfloat16, {}),
    "AdamW8bit-bf16-remainder": (mpfused.AdamW8bit, torch.bfloat16,
                                 {"min_8bit_size": 512, "master_weights": "remainder"}),
    "SGD-bf16-nesterov": (mpfused.SGD, torch.bfloat16, {"momentum": 0.9, "nesterov": True}),
    "Lion-fp32": (mpfused.Lion, torch.float32, {}),
}


def _change_options(opt, step):
    """Options a user may change between steps: each step goes through a different set."""
    g = opt.param_groups[0]
    if step == 3 and "weight_decay" in g:
        g["weight_decay"] = 0.05
    if step == 5 and "betas" in g:
        g["betas"] = (0.8, 0.95)
    if step == 7 and "maximize" in g:
        g["maximize"] = True


def _train(case, prepared: bool, steps=10, scaler_on=True, counts=None):
    """Release training with a LambdaLR (lr changes every step), options changed between steps,
    NaN/inf in some grads on some steps and (fp16-style) a GradScaler; the final snapshot and
    per step (skipped, found flags, scale). ``prepared=False``: the handle's _prepare_calls is
    switched off, so every bucket goes through _update."""
    cls, dtype, kwargs = CASES[case]
    model = _model(dtype)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler_on \
        else None
    release = mpfused.step_in_backward(opt, scaler=scaler, bucket_bytes=2048)
    if not prepared:
        release._prepare_calls = lambda device: None
    now = _inject_hooks(model, {2: {0}, 6: {3, 5}})  # NaN/inf in these params' grads
    gen = torch.Generator().manual_seed(3)
    record = []
    for step in range(steps):
        now["step"] = step
        _change_options(opt, step)
        loss = model(torch.randn(5, 24, generator=gen).to(dtype)).float().square().mean()
        armed = [c.armed and c.armed[2] for c in release._chunks]
        n_updates = _count_updates(counts, lambda: (scaler.scale(loss) if scaler else loss)
                                   .backward())
        record.append((int(release.skipped), {d: float(f) for d, f in
                                              release.found_inf_per_device().items()}))
        if counts is not None:
            counts.append((n_updates, sum(c.call is not None for c in release._chunks),
                           len(release._chunks),
                           sum(c.armed is not None and c.armed[2] is not a
                               for c, a in zip(release._chunks, armed))))
        _finish_step(opt, scaler, record)
        sched.step()
    return _snapshot(model, opt), record


def _count_updates(counts, fn) -> int:
    """How many release buckets went through _update while fn ran."""
    if counts is None:
        fn()
        return 0
    seen = []
    orig = GradRelease._update

    def spy(self, *a, **k):
        seen.append(1)
        return orig(self, *a, **k)
    GradRelease._update = spy
    try:
        fn()
    finally:
        GradRelease._update = orig
    return len(seen)


@pytest.mark.parametrize("scaler_on", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_prepared_calls_equal_the_update_path(case, scaler_on):
    counts = []
    a, rec_a = _train(case, True, scaler_on=scaler_on, counts=counts)
    b, rec_b = _train(case, False, scaler_on=scaler_on)
    assert rec_a == rec_b
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(r[0] for r in rec_a if isinstance(r, tuple))  # the injected steps skipped
    # the first backward plans the buckets (all through _update); from the second on every
    # whole bucket is prepared: with one planner bucket per release bucket (all but the 8-bit
    # case's mixed one), none goes through _update
    n_chunks = counts[0][2]
    assert counts[0][:2] == (n_chunks, 0)
    for n_updates, n_prepared, _, _ in counts[1:]:
        assert n_updates + n_prepared == n_chunks and n_prepared >= 1
        if case != "AdamW8bit-bf16-remainder":
            assert n_updates == 0
    # armed once (step 1) and again only where a non-float option changed (maximize, step 7):
    # the scheduler's lr (every step), weight_decay and betas are set in the armed steps
    armed_anew = [c[3] for c in counts]
    assert armed_anew[1] == counts[1][1]
    assert [k for k, n in enumerate(armed_anew) if n] == [1, 7]


class _FakeArmed:
    """An ArmedStep stand-in for _brought_to: records set() calls; ``doubles``: the indices
    that hold a double."""
    def __init__(self, doubles):
        self.doubles, self.sets = doubles, []

    def set(self, i, v):
        self.sets.append((i, v))
        return i in self.doubles


def test_brought_to_sets_changed_floats_and_refuses_the_rest():
    t, u = torch.zeros(()), torch.zeros(())
    armed = (0.1, None, 0.9, True, 1, t)
    step = _FakeArmed({0, 2})
    assert _brought_to(step, armed, armed) and step.sets == []
    assert _brought_to(step, armed, (0.2, None, 0.9, True, 1, t)) and step.sets == [(0, 0.2)]
    cases = [
        ((0.1, None, 0.9, True, 1, u), []),  # another tensor: armed again
        ((0.1, None, 0.9, False, 1, t), []),  # a bool
        ((0.1, None, 0.9, True, 2, t), []),  # an int
        ((0.1, t, 0.9, True, 1, t), []),  # None -> a tensor
        ((0.1, None, 0.9, True, 1), []),  # another length
        ((0.1, 0.5, 0.9, True, 1, t), []),  # None -> a float
    ]
    for args, sets in cases:
        step = _FakeArmed({0, 2})
        assert not _brought_to(step, armed, args), args
        assert step.sets == sets
    step = _FakeArmed({0, 2})  # a zero's sign is set; a NaN is set again every time
    assert _brought_to(step, (0.0, None, 0.9, True, 1, t), (-0.0, None, math.nan, True, 1, t))
    assert [i for i, _ in step.sets] == [0, 2] and math.copysign(1.0, step.sets[0][1]) < 0
    assert not _brought_to(_FakeArmed({2}), (0.1,), (0.2,))  # not a double there: armed again


def test_armed_step_contract():
    """The native ArmedStep: set() takes doubles only, by index after the grads; run() with a
    param that has no grad does nothing and says so; run() frees the grads."""
    model = _model(torch.bfloat16)
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    release = mpfused.step_in_backward(opt, bucket_bytes=1 << 20)
    for _ in range(2):
        model(torch.randn(5, 24).bfloat16()).float().square().mean().backward()
        opt.step()
    chunk = release._chunks[0]
    op, args, step, _ = chunk.armed
    doubles = [i for i, a in enumerate(args) if type(a) is float]
    assert doubles and all(step.set(i, args[i]) for i in doubles)
    assert not any(step.set(i, 1.0) for i in range(len(args)) if i not in doubles)
    assert not step.set(-1, 1.0) and not step.set(len(args), 1.0)
    params = chunk.params
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad = None
    assert not step.run()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert params[0].grad is None and all(p.grad is not None for p in params[1:])
    params[0].grad = torch.ones_like(params[0])
    release._start_backward(params[0].device, queue_end=False)
    release._prepare_calls(params[0].device)  # this backward's flags
    release._in_backward = False
    assert chunk.armed[2] is step and step.run()
    assert all(p.grad is None for p in params)
    assert not any(torch.equal(a, p) for a, p in zip(before, params))


def _run_with_state_write(release_on: bool):
    """A hook on the first param released replaces the exp_avg of a param released later in
    the same backward (a write to the optimizer state, which re-plans): the update must use
    the new tensor. The ordinary step sees the same write before opt.step()."""
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    opt = mpfused.AdamW(params, lr=1e-2)
    release = mpfused.step_in_backward(opt, bucket_bytes=600) if release_on else None
    gen = torch.Generator().manual_seed(1)
    fired = {"on": False}

    def replace_state(_):
        if fired["on"]:
            st = opt.state[params[0]]
            st["exp_avg"] = st["exp_avg"] * 0.5  # a new tensor
            fired["on"] = False
    params[-1].register_post_accumulate_grad_hook(replace_state)  # the last layer: first ready
    updates = []
    for step in range(4):
        fired["on"] = step == 2
        loss = model(torch.randn(5, 24, generator=gen).bfloat16()).float().square().mean()
        updates.append(_count_updates([], loss.backward))
        opt.step()
        opt.zero_grad()
    return _snapshot(model, opt), updates, release


def test_a_state_write_in_the_backward_is_seen():
    ordinary, _, _ = _run_with_state_write(False)
    released, updates, release = _run_with_state_write(True)
    assert len(ordinary) == len(released)
    assert all(torch.equal(x, y) for x, y in zip(ordinary, released))
    # step 2: the buckets after the write went through _update (re-planned), not the stale call
    assert updates[1] == 0 and updates[2] >= 1 and updates[3] == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_partial_bucket_and_create_graph_take_the_update_path():
    """A bucket with a param that gets no grad this step is released in part at the end of the
    backward, and a backward with create_graph=True records nothing: both through _update,
    both equal to the ordinary step."""
    results = []
    for release_on in (False, True):
        model = _model(torch.float32)
        params = list(model.parameters())
        opt = mpfused.AdamW(params, lr=1e-2)
        if release_on:
            mpfused.step_in_backward(opt, bucket_bytes=1 << 20)  # one bucket: all params
        gen = torch.Generator().manual_seed(2)
        updates = []
        for step in range(5):
            x = torch.randn(5, 24, generator=gen)
            if step == 2:  # the last layer's bias gets no grad: its bucket is partial
                h = model[:4](x)
                out = torch.nn.functional.linear(h, model[4].weight)
                loss = out.square().mean()
            else:
                loss = model(x).square().mean()
            graph = step == 3
            updates.append(_count_updates([], lambda: loss.backward(create_graph=graph)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append((_snapshot(model, opt), updates))
    (a, _), (b, updates) = results
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert updates == [1, 0, 1, 1, 0]


def _run_between_steps(change, release_on: bool, cls=mpfused.AdamW, kwargs=None, steps=5):
    """Train 5 steps; ``change(opt, step)`` runs before each backward."""
    model = _model(torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2, **(kwargs or {}))
    if release_on:
        mpfused.step_in_backward(opt, bucket_bytes=2048)
    gen = torch.Generator().manual_seed(4)
    for step in range(steps):
        change(opt, step)
        model(torch.randn(5, 24, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _snapshot(model, opt)


def _replace_state_table(opt, step):
    """A new state table (not a write to the tracked one) holding new, halved moments."""
    if step == 3:
        new = collections.defaultdict(dict)
        for p, st in opt.state.items():
            new[p] = {k: (v * 0.5 if k == "exp_avg" else v) for k, v in st.items()}
        opt.state = new


def _toggle_plan_options(opt, step):
    """Options the kernel plan depends on: amsgrad on (a new state key), master_weights."""
    g = opt.param_groups[0]
    if step == 2:
        g["amsgrad"] = True
    if step == 3:
        g["master_weights"] = "remainder"


@pytest.mark.parametrize("change", [_replace_state_table, _toggle_plan_options])
def test_changes_between_steps_re_plan(change):
    ordinary = _run_between_steps(change, False)
    released = _run_between_steps(change, True)
    assert len(ordinary) == len(released)
    assert all(torch.equal(x, y) for x, y in zip(ordinary, released))


def test_a_subclass_launch_is_called_for_every_bucket():
    """A subclass that overrides _launch (not _launch_args) gets every release bucket's launch
    through it, on every backward: the prepared calls step aside."""
    launches, now = [], [0]

    class Counting(mpfused.AdamW):
        def _launch(self, b, grads, group, hyper, scaling):
            launches.append(now[0])
            super()._launch(b, grads, group, hyper, scaling)

    def mark(opt, step):
        now[0] = step
    ordinary = _run_between_steps(mark, False, cls=Counting)
    launches.clear()
    released = _run_between_steps(mark, True, cls=Counting)
    assert all(torch.equal(x, y) for x, y in zip(ordinary, released))
    per_step = collections.Counter(launches)  # every backward launches every bucket
    assert sorted(per_step) == list(range(5)) and len(set(per_step.values())) == 1
    assert per_step[0] > 1  # (several release buckets)


def _train_counting_args(cls, prepared: bool, changes: dict, steps: int, **kwargs):
    """AdamW-like release training with ``changes[step](opt)`` applied before that step's
    backward; the final snapshot and, per backward, how often ``_launch_args`` ran in it (in
    _update or while arming)."""
    model = _model(torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    release = mpfused.step_in_backward(opt, bucket_bytes=2048)
    if not prepared:
        release._prepare_calls = lambda device: None
    calls = []
    orig = opt._launch_args
    opt._launch_args = lambda *a: (calls.append(1), orig(*a))[1]
    gen = torch.Generator().manual_seed(5)
    made = []
    for step in range(steps):
        if step in changes:
            changes[step](opt)
        calls.clear()
        model(torch.randn(5, 24, generator=gen).bfloat16()).float().square().mean().backward()
        made.append(len(calls))
        opt.step()
        opt.zero_grad()
    return _snapshot(model, opt), made, len(release._chunks)


def _set(key, value):
    return lambda opt: opt.param_groups[0].__setitem__(key, value)


CHANGES = {3: _set("weight_decay", 0.1),
           5: lambda opt: opt.param_groups[0].__setitem__("lr", torch.tensor(5e-3)),  # (a new one)
           6: lambda opt: opt.param_groups[0]["lr"].fill_(2e-3), 7: _set("lr", 1e-3)}


def test_unchanged_backwards_keep_the_armed_calls():
    """A backward where nothing the calls are made from changed (no scheduler) makes none:
    _launch_args does not run in it. A changed option (step 3), a tensor lr (steps 5-6: copied
    to the device each backward, so never kept; step 6 changes it in place) and a new float lr
    (step 7) make them again; every step equals the _update path bit for bit."""
    a, made, n = _train_counting_args(mpfused.AdamW, True, CHANGES, 9)
    b, _, _ = _train_counting_args(mpfused.AdamW, False, CHANGES, 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert made == [n, n, 0, n, 0, n, n, n, 0]


EVERY_OPTIMIZER = [mpfused.Adam, mpfused.AdamW, mpfused.SGD, mpfused.Lion,
                   mpfused.Adam8bit, mpfused.AdamW8bit, mpfused.SGD8bit, mpfused.Lion8bit,
                   mpfused.Adam4bit, mpfused.AdamW4bit, mpfused.SGD4bit, mpfused.Lion4bit]


@pytest.mark.parametrize("cls", EVERY_OPTIMIZER, ids=lambda c: c.__name__)
def test_every_optimizer_keeps_its_armed_calls(cls):
    """No optimizer makes its armed calls again in a backward where nothing changed: each plan
    option must be the same object from backward to backward (_calls_signature compares by
    identity). The 8-bit and 4-bit optimizers' override epoch was a new tuple each call, so
    they armed every bucket again in every backward (~120 us a backward on the main job's
    model, cold). Low-bit state on the larger weights (min_8bit_size)."""
    low_bit = "8bit" in cls.__name__ or "4bit" in cls.__name__
    kwargs = {"min_8bit_size": 512} if low_bit else {}
    if cls.__name__.startswith("SGD"):
        kwargs["momentum"] = 0.9  # (the low-bit SGDs' state is the momentum buffer)
    _, made, n = _train_counting_args(cls, True, {}, 5, **kwargs)
    assert n > 1 and made == [n, n, 0, 0, 0]  # (the first backward plans, the second arms)


def test_a_subclass_launch_args_is_asked_every_backward():
    class Own(mpfused.AdamW):
        def _launch_args(self, b, group, hyper, scaling):
            return super()._launch_args(b, group, hyper, scaling)
    a, made, n = _train_counting_args(Own, True, {}, 4)
    b, _, _ = _train_counting_args(Own, False, {}, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert made == [n] * 4


def _train_keeping_flags(ahead: bool, scaler_on: bool, worker_threads: int, steps=6):
    """AdamW8bit release training with non-finite grads on step 2 (one param) and step 4 (two
    params of different buckets); per step the ``skipped`` tensor, the found flag and, before
    the backward, the skipped tensor made ahead (None where none was)."""
    model = _model(torch.float16 if scaler_on else torch.bfloat16)
    opt = mpfused.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=512)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0 ** 8) if scaler_on else None
    release = mpfused.step_in_backward(opt, scaler=scaler, bucket_bytes=2048,
                                       worker_threads=worker_threads)
    if not ahead:
        release._make_flags_ahead = lambda: None
    hooks = _inject_hooks(model, {2: {0}, 4: {2, 4}})
    gen = torch.Generator().manual_seed(3)
    rows = []
    for step in range(steps):
        hooks["step"] = step
        made = release._ahead.get(torch.device("cpu"))
        loss = model(torch.randn(5, 24, generator=gen).to(model[0].weight.dtype)).float()
        loss = loss.square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        rows.append((release.skipped, release.found_inf_per_device()[torch.device("cpu")],
                     None if made is None else made[0]))
        _finish_step(opt, scaler, [])
    return _snapshot(model, opt), rows


@pytest.mark.parametrize("worker_threads", [0, 1], ids=["in-backward", "worker"])
@pytest.mark.parametrize("scaler_on", [False, True])
def test_flags_made_ahead_are_new_each_backward(scaler_on, worker_threads):
    """opt.step() makes the next backward's flag tensors outside the backward
    (_make_flags_ahead) where no scale is read: that backward takes them (release.skipped is
    the one made ahead), each backward's skipped and found flag are new tensors that later
    backwards leave as they were, and training equals the same run without them bit for bit.
    With a GradScaler none are made (the inverse scale comes from the scale)."""
    a, rows = _train_keeping_flags(True, scaler_on, worker_threads)
    b, rows_b = _train_keeping_flags(False, scaler_on, worker_threads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    want = [0, 0, 1, 0, 2, 0]  # (step 4: params 2 and 4 lie in different 2 KiB buckets)
    for got in (rows, rows_b):
        assert [int(s) for s, _, _ in got] == want
        assert [float(f) for _, f, _ in got] == [float(w > 0) for w in want]
        assert len({id(t) for row in got for t in row[:2]}) == 2 * len(got)  # all new
    made = [m for _, _, m in rows]
    if scaler_on:
        assert made == [None] * len(rows)
    else:
        # (the first backward plans, the second arms: from the third on they are made ahead)
        assert made[:2] == [None, None] and all(m is s for m, (s, _, _) in zip(made[2:], rows[2:]))
    assert all(m is None for _, _, m in rows_b)


def test_a_compiled_step_with_release_attached():
    """opt.step() compiled with fullgraph=True while release is attached (the step only ends
    the backward's bookkeeping): the flags are then not made ahead (a TorchScript-class call
    does not trace) and the next backward makes them; training equals the eager steps."""
    def run(compiled: bool):
        model = _model(torch.float32)
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
        release = mpfused.step_in_backward(opt, bucket_bytes=2048, worker_threads=0)
        step = torch.compile(opt.step, fullgraph=True, backend="eager") if compiled else opt.step
        gen = torch.Generator().manual_seed(7)
        skipped = []
        for _ in range(4):
            model(torch.randn(5, 24, generator=gen)).square().mean().backward()
            skipped.append(release.skipped)
            step()
        return _snapshot(model, opt), [int(s) for s in skipped]
    torch._dynamo.reset()
    try:
        a, sa = run(True)
    finally:
        torch._dynamo.reset()
    b, sb = run(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa == sb == [0] * 4
