"""The op entry points (issue 21): every schema takes its operands (tensor lists, operand tensors)
positionally and every scalar, option and optional tensor after ``*``; each op has one typed
wrapper with a docstring and the schema's parameters; the fake kernels check list lengths, dtypes
and devices and name the argument, in fake mode and under ``torch.compile``."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mpfused  # noqa: F401  (defines and routes the ops)
from benchmarks.smoke_cases import FAMILIES, cases, inputs
from mpfused.ops import OPS
from mpfused.ops.bound import BoundOp
from mpfused.ops.registry import REQUIRED

STEP_OPS = sorted(n for n in OPS if n.endswith("_step_"))


def _schema(name):
    return torch._C.parse_schema(OPS[name].schema)


def _is_operand(arg) -> bool:
    """A tensor list or a (non-optional) tensor: what the ops take positionally."""
    return str(arg.type) in ("List[Tensor]", "Tensor")


def test_every_op_is_covered():
    assert set(FAMILIES) | {"sgd4bit_step_", "lion4bit_step_"} == set(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_scalars_are_keyword_only(name):
    args = _schema(name).arguments
    for a in args:
        assert a.kwarg_only != _is_operand(a), (
            f"{name}: {a.name} ({a.type}) must be "
            f"{'positional' if _is_operand(a) else 'keyword-only (after *)'}")
    # the operands come first: keyword-only arguments are still positional in C++, so the unboxed
    # kernel signatures (csrc/bindings/op_signatures.h) keep the schema's order
    kinds = [a.kwarg_only for a in args]
    assert kinds == sorted(kinds)


@pytest.mark.parametrize("name", sorted(OPS))
def test_wrapper_has_the_schema_parameters_and_a_docstring(name):
    op = OPS[name]
    fn = op.wrapper
    assert fn is not None and fn.op is op and fn.__name__ == name
    module = __import__(fn.__module__, fromlist=[name])
    assert getattr(module, name) is fn  # the public entry, beside the schema
    assert fn.__doc__ and len(fn.__doc__.strip()) > 80, f"{name}: wrapper without a docstring"
    params = list(inspect.signature(fn).parameters.values())
    assert params[-1].name == "backend" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
    assert params[-1].default is None
    args = _schema(name).arguments
    assert [p.name for p in params[:-1]] == [a.name for a in args]
    defaults = dict(op.keyword_args)
    for p, a in zip(params, args):
        want = inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else (
            inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert p.kind is want, (name, p.name)
        assert p.annotation is not inspect.Parameter.empty, (name, p.name)
        if a.kwarg_only:
            d = defaults[a.name]
            assert (p.default is inspect.Parameter.empty) == (d is REQUIRED), (name, p.name)
            if d is not REQUIRED:
                assert p.default == d, (name, p.name)


@pytest.mark.parametrize("name", sorted(OPS))
def test_python_implementations_take_the_schema_keywords(name):
    """The dispatcher hands Python kernels keyword-only arguments as keywords."""
    names = [a.name for a in _schema(name).arguments]
    impls = [OPS[name].reference]
    try:
        import mpfused.triton_kernels  # noqa: F401
        impls.append(OPS[name].triton)
    except ImportError:
        pass
    for impl in impls:
        sig = inspect.signature(inspect.unwrap(impl))
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            continue  # adam4bit_step_'s Triton entry forwards to adam8bit_step_'s
        params = [p for p in sig.parameters.values() if not p.name.startswith("_")]
        assert [p.name for p in params] == names, impl
        for p, a in zip(params, _schema(name).arguments):
            assert (p.kind is inspect.Parameter.KEYWORD_ONLY) == a.kwarg_only, (impl, p.name)


def test_positional_scalars_are_refused():
    p = [torch.zeros(2)]
    with pytest.raises(RuntimeError, match="positional argument"):
        torch.ops.mpfused.check_grads.default(p, torch.zeros(()), torch.ones(()), None)
    with pytest.raises(TypeError):
        OPS["check_grads"].wrapper(p, torch.zeros(()), torch.ones(()), None)


# ---- fake kernels --------------------------------------------------------------------------------
def _case(op, dtype="bf16", mode="fp32-master"):
    gen = torch.Generator().manual_seed(0)
    if op in ("check_grads", "unscale_grads_", "update_scale_"):
        mode = "-"
    elif op.startswith("sgd"):
        mode = f"momentum/{mode}"
    return inputs(op, dtype, mode, gen)[:2]


def _fake(fake_mode, obj):
    if isinstance(obj, torch.Tensor):
        return fake_mode.from_tensor(obj)
    if isinstance(obj, list):
        return [_fake(fake_mode, x) for x in obj]
    if isinstance(obj, dict):
        return {k: _fake(fake_mode, v) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("case", cases(["native"]), ids=lambda c: "-".join(c[0:1] + c[2:]))
def test_fake_kernels_accept_every_valid_call(case):
    op, _, dtype, mode = case
    args, kwargs, _ = inputs(op, dtype, mode, torch.Generator().manual_seed(0))
    with FakeTensorMode() as fm:
        getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))


# (op, operand index, what to do, the message): the first state list of each step op
BAD = [(op, 2, kind) for op in STEP_OPS for kind in ("short", "dtype", "device")]


def _bad_case(op, index, kind):
    """_case(op) with operand ``index`` broken by ``kind``: (args, kwargs, the message)."""
    args, kwargs = _case(op)
    name = _schema(op).arguments[index].name
    lst = args[index]
    if kind == "short":
        args[index] = lst[:-1]
        match = rf"mpfused: {op}: {name} has {len(lst) - 1} tensors, expected {len(lst)}"
    elif kind == "dtype":
        wrong = torch.float64 if lst[1].dtype != torch.float64 else torch.float32
        args[index] = lst[:1] + [lst[1].to(wrong)] + lst[2:]
        match = rf"mpfused: {op}: {name}\[1\] has dtype {wrong}, expected {lst[1].dtype}"
    else:
        args[index] = lst[:1] + [torch.empty_like(lst[1], device="meta")] + lst[2:]
        match = rf"mpfused: {op}: {name}\[1\] is on meta, expected cpu"
    return args, kwargs, match


@pytest.mark.parametrize("op,index,kind", BAD)
def test_fake_kernel_names_the_bad_argument(op, index, kind):
    args, kwargs, match = _bad_case(op, index, kind)
    with FakeTensorMode() as fm:
        with pytest.raises(RuntimeError, match=match):
            getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))


def _operand_lists(args):
    return [t for a in args if isinstance(a, list) for t in a if t.device.type == "cpu"]


def _bits(tensors):
    """Each tensor's bytes (NaN-safe, any layout)."""
    return [t.reshape(-1).contiguous().view(torch.uint8).clone() for t in tensors]


@pytest.mark.parametrize("op,index,kind", BAD)
def test_triton_launcher_checks_with_the_fake_kernels_rules(op, index, kind):
    """Each operand rule is stated once in Python (mpfused/operand_checks.py): the Triton launcher
    calls the fake kernel's function (values=True), so the same fault gets the same message,
    before anything is written."""
    if "triton" not in OPS[op].available("cpu"):
        pytest.skip("no Triton")
    args, kwargs, match = _bad_case(op, index, kind)
    with FakeTensorMode() as fm:
        with pytest.raises(RuntimeError, match=match) as fake_error:
            getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))
    tensors = _operand_lists(args)
    before = _bits(tensors)
    with pytest.raises(RuntimeError, match=match) as run_error:
        OPS[op](*args, **kwargs, backend="triton")
    assert str(run_error.value) == str(fake_error.value)
    assert all(torch.equal(a, b) for a, b in zip(_bits(tensors), before))


@pytest.mark.parametrize("op", STEP_OPS)
def test_size_rules_are_checked_at_run_time_only(op):
    """Sizes are values the fake kernels leave alone (values=False); the Triton launcher refuses
    a state tensor one element short, naming it and the rule."""
    args, kwargs = _case(op)
    name = _schema(op).arguments[2].name
    lst = args[2]
    args[2] = lst[:1] + [lst[1].reshape(-1)[:-1].clone()] + lst[2:]
    with FakeTensorMode() as fm:
        getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))
    if "triton" not in OPS[op].available("cpu"):
        pytest.skip("no Triton")
    tensors = _operand_lists(args)
    before = _bits(tensors)
    with pytest.raises(RuntimeError, match=rf"mpfused: {op}: {name}\[1\] must be .*, got "
                                           rf"\[{lst[1].numel() - 1}\]"):
        OPS[op](*args, **kwargs, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(_bits(tensors), before))


BAD_KEYWORDS = [
    ("adam_step_", "found_inf", torch.zeros((), dtype=torch.float64),
     r"adam_step_: found_inf has dtype torch.float64, expected torch.float32"),
    ("adam_step_", "grad_scale", torch.ones((), device="meta"),
     r"adam_step_: grad_scale is on meta, expected cpu"),
    ("sgd_step_", "param_ids", [0, 1],
     r"sgd_step_: param_ids has 2 entries, expected 6"),
    ("lion8bit_step_", "master_mode", 9, r"lion8bit_step_: master_mode must be 0"),
    ("check_grads", "norm_sq", torch.zeros((), dtype=torch.float16),
     r"check_grads: norm_sq has dtype torch.float16, expected torch.float32"),
]


@pytest.mark.parametrize("op,key,value,match", BAD_KEYWORDS)
def test_fake_kernel_checks_the_keyword_arguments(op, key, value, match):
    args, kwargs = _case(op)
    kwargs[key] = value
    with FakeTensorMode() as fm:
        with pytest.raises(RuntimeError, match=match):
            getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))


@pytest.mark.parametrize("op,key,value,match", BAD_KEYWORDS)
def test_triton_launcher_checks_the_keyword_arguments_alike(op, key, value, match):
    if "triton" not in OPS[op].available("cpu"):
        pytest.skip("no Triton")
    args, kwargs = _case(op)
    kwargs[key] = value
    with FakeTensorMode() as fm:
        with pytest.raises(RuntimeError, match=match) as fake_error:
            getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))
    with pytest.raises(RuntimeError, match=match) as run_error:
        OPS[op](*args, **kwargs, backend="triton")
    assert str(run_error.value) == str(fake_error.value)


# The run-time rule for the step counters, every backend of every step op: a 1-element float32
# tensor, refused with the native binding's message before anything is written (the Triton
# launchers once took a float64 or float16 counter, and an integer one only failed in the
# counter's advance, after the update). The "reference" backend (the float64 model the kernels
# are tested against) is not an argument checker and is left out.
STEP_COUNTER_BAD = {"float64": lambda t: t.double(), "float16": lambda t: t.half(),
                    "int32": lambda t: t.int(), "two-element": lambda t: t.repeat(2)}


@pytest.mark.parametrize("bad", sorted(STEP_COUNTER_BAD))
@pytest.mark.parametrize("op", STEP_OPS)
def test_bad_step_counter_refused_on_every_backend(op, bad):
    index = [a.name for a in _schema(op).arguments].index("steps")
    backends = [b for b in OPS[op].available("cpu") if b != "reference"]
    assert backends, "no kernel backend on the CPU"
    for backend in backends:
        args, kwargs, _ = inputs(op, "fp32", "none", torch.Generator().manual_seed(0), count=3)
        args[index][1] = STEP_COUNTER_BAD[bad](args[index][1])
        before = [[t.clone() for t in a] if isinstance(a, list) else a for a in args]
        with pytest.raises(RuntimeError,
                           match=r"steps\[1\] must be a 1-element float32 tensor on cpu"):
            OPS[op](*args, **kwargs, backend=backend)
        for a, b in zip(args, before):
            if isinstance(a, list):
                assert all(torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                           for x, y in zip(a, b)), (backend, "changed")


@pytest.mark.parametrize("key", ["grad_scale", "found_inf", "norm_sq"])
@pytest.mark.parametrize("op", STEP_OPS)
def test_bad_amp_scalar_refused_on_every_backend(op, key):
    """The AMP scalars' run-time rule (a 1-element float32 tensor), native and Triton alike."""
    backends = [b for b in OPS[op].available("cpu") if b != "reference"]
    for backend in backends:
        args, kwargs, _ = inputs(op, "fp32", "none", torch.Generator().manual_seed(0), count=3)
        kwargs[key] = kwargs[key].double()
        before = [[t.clone() for t in a] for a in args if isinstance(a, list)]
        with pytest.raises(RuntimeError, match=rf"{key} must be a 1-element float32 tensor"):
            OPS[op](*args, **kwargs, backend=backend)
        after = [a for a in args if isinstance(a, list)]
        assert all(torch.equal(x, y) for a, b in zip(after, before) for x, y in zip(a, b)), \
            backend


# The signed map's value rule of the 8-bit ops (operand_checks.check_signed_map): +0.0 above its
# lowest entry, so a zero moment encodes exactly and the sign rule has a code below +0. Maps that
# break it: bitsandbytes' unsigned map (+0 is its lowest entry), a sorted map without a zero, and
# the signed map with -0.0 in place of +0.0.
def _map_without_plus_zero(kind):
    from mpfused import quant_maps as qm
    if kind == "unsigned":
        return qm.unsigned_map("cpu").clone()
    if kind == "no-zero":
        return torch.linspace(-1, 1, 256)
    q = qm.signed_map("cpu").clone()
    q[qm.zero_code(q)] = -0.0
    return q


def _bad_map_refused_everywhere(op, make_map, rule):
    """Every backend (native, Triton, the reference) refuses the map ``make_map(its good map)``
    in the op's first map argument with the same message ``rule`` (the native binding's has no
    op name) and writes nothing; a value rule, so the fake kernel leaves it alone."""
    names = [a.name for a in _schema(op).arguments]
    index = next(i for i, n in enumerate(names) if n.startswith("qmap"))
    backends = OPS[op].available("cpu")  # the float64 reference too: it refuses what kernels do
    assert any(b != "reference" for b in backends), "no kernel backend on the CPU"
    messages = {}
    for backend in backends:
        args, kwargs, outputs = inputs(op, "bf16", "fp32-master",
                                       torch.Generator().manual_seed(0))
        args[index] = make_map(args[index])
        if backend == backends[0]:
            with FakeTensorMode() as fm:
                getattr(torch.ops.mpfused, op).default(*_fake(fm, args), **_fake(fm, kwargs))
        before = _bits(outputs)
        with pytest.raises(RuntimeError, match=rf"mpfused: ({op}: )?{names[index]} \(signed "
                                               rf"map\) {rule}") as error:
            OPS[op](*args, **kwargs, backend=backend)
        messages[backend] = str(error.value).splitlines()[0].replace(f"{op}: ", "")
        assert all(torch.equal(a, b) for a, b in zip(_bits(outputs), before)), (backend,
                                                                                "changed")
    assert set(messages) == set(backends), messages  # every backend raised, none skipped
    assert len(set(messages.values())) == 1, messages


@pytest.mark.parametrize("kind", ["unsigned", "no-zero", "minus-zero"])
@pytest.mark.parametrize("op", ["adam8bit_step_", "sgd8bit_step_", "lion8bit_step_"])
def test_signed_map_without_plus_zero_refused_on_every_backend(op, kind):
    _bad_map_refused_everywhere(op, lambda good: _map_without_plus_zero(kind),
                                r"must hold \+0\.0 above its lowest entry")


def test_fake_kernel_of_update_scale_checks_the_trackers():
    args, kwargs = _case("update_scale_")
    args[1] = args[1].long()
    with FakeTensorMode() as fm:
        with pytest.raises(RuntimeError, match=r"update_scale_: growth_tracker has dtype "
                                               r"torch.int64, expected torch.int32"):
            torch.ops.mpfused.update_scale_.default(*_fake(fm, args), **_fake(fm, kwargs))


def test_compile_error_names_the_argument():
    """torch.compile traces the op through its fake kernel: a wrong operand fails at trace time
    with the fake kernel's message (the argument and the rule), not deep inside a kernel."""
    args, kwargs = _case("adam_step_", dtype="fp32", mode="none")
    args[3] = args[3][:1] + [args[3][1].half()] + args[3][2:]  # exp_avg_sqs[1] fp16

    @torch.compile(backend="eager", fullgraph=True)
    def step(args, kwargs):
        OPS["adam_step_"].wrapper(*args, **kwargs)

    with pytest.raises(Exception, match=r"adam_step_: exp_avg_sqs\[1\] has dtype torch.float16, "
                                        r"expected torch.float32"):
        step(args, kwargs)


# ---- BoundOp: keywords in, the C++ method's positional order out --------------------------------
def test_bound_op_refuses_missing_or_unknown_keywords():
    args, kwargs = _case("lion_step_", dtype="fp32", mode="none")
    bound = BoundOp(OPS["lion_step_"].wrapper, [args[0]] + args[2:])
    if bound.native() is None or not OPS["lion_step_"].native_available("cpu"):
        pytest.skip("no native extension")
    partial = {k: v for k, v in kwargs.items() if k != "beta2"}
    with pytest.raises(TypeError, match="missing keyword argument.*beta2"):
        bound(args[1], **partial)
    with pytest.raises(TypeError, match="unexpected keyword argument.*betas"):
        bound(args[1], **kwargs, betas=(0.9, 0.99))


@pytest.mark.parametrize("op", ["adam8bit_step_", "adam4bit_step_", "sgd8bit_step_",
                                "sgd4bit_step_", "lion8bit_step_", "lion4bit_step_"])
def test_unsorted_map_refused_on_every_backend(op):
    """A map must be strictly increasing (the codecs' thresholds are midpoints of neighbours):
    two swapped entries (operand_checks.check_qmap / quant8_args.h check_qmap_values)."""
    def swapped(good):
        q = good.clone()
        q[[1, 2]] = q[[2, 1]]
        return q
    _bad_map_refused_everywhere(op, swapped, r"must be strictly increasing \(sorted\)")
