"""mpfused.amp recipes: cast_model (fp32 islands and their boundary casts), setup, autocast.
estimate_memory: tests/test_recipes_memory.py; the README's recipes: tests/test_readme_recipes.py."""
import collections
import copy
import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpfused
from mpfused import amp

HALF = [torch.bfloat16, torch.float16]
HAS_8BIT = hasattr(mpfused, "AdamW8bit")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: intra-op threads only add contention (minutes on a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Probe(nn.Module):
    """Records the dtype it sees and whether autocast was on."""

    def __init__(self, n=8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.seen = []

    def forward(self, x):
        self.seen.append((x.dtype, self.weight.dtype, torch.is_autocast_enabled("cpu")))
        return x * self.weight


class MyRMSNorm(nn.Module):  # a third-party norm, recognized by its class name
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.rms = MyRMSNorm(8)
        self.probe = Probe(8)
        self.after = Probe(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        x = self.ln(self.fc1(x))
        x = self.gn(self.bn(x))
        x = self.after(self.probe(self.rms(x)))
        return self.fc2(x)


def _dtypes(model):
    return {n: p.dtype for n, p in model.named_parameters()}


# ---- cast_model ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cast_model_keeps_norms_fp32(dtype):
    model = amp.cast_model(Net(), dtype)
    d = _dtypes(model)
    for name in ("ln", "bn", "gn", "rms"):
        assert all(v == torch.float32 for k, v in d.items() if k.startswith(name + ".")), name
    for name in ("fc1", "fc2", "probe", "after"):
        assert all(v == dtype for k, v in d.items() if k.startswith(name + ".")), name
    assert model.bn.running_mean.dtype == torch.float32
    assert model.bn.num_batches_tracked.dtype == torch.int64
    assert model._mpfused_amp.fp32_modules == ("ln", "bn", "gn", "rms")
    assert amp.is_norm_layer("x", nn.RMSNorm(4)) and amp.is_norm_layer("x", nn.InstanceNorm1d(4))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_island_boundaries(dtype):
    model = amp.cast_model(Net(), dtype, keep_fp32=(amp.is_norm_layer, "probe"), cast_inputs=True)
    model.after.seen.clear()
    x = torch.randn(4, 8)  # fp32 input: cast to the model dtype by the root hook
    out = model(x)
    assert out.dtype == dtype
    # `probe` is an island: fp32 input, fp32 weight; `after` is not: it sees probe's output cast back
    assert model.probe.seen[-1] == (torch.float32, torch.float32, False)
    assert model.after.seen[-1][:2] == (dtype, dtype)
    # the LayerNorm island computes in fp32 on the upcast 16-bit activation and returns 16-bit
    h = model.fc1(x.to(dtype))
    got = model.ln(h)
    assert got.dtype == dtype
    want = F.layer_norm(h.float(), (8,), model.ln.weight, model.ln.bias, model.ln.eps).to(dtype)
    assert torch.equal(got, want)
    out.float().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name


def test_fp32_outputs_in_containers():
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.ln = nn.LayerNorm(4)

        def forward(self, x, ids):
            y = self.fc(x)
            Pair = collections.namedtuple("Pair", "a b")
            return {"y": y, "pair": Pair(y, self.ln(y)), "list": [y, ids], "ids": ids}

    model = amp.cast_model(Multi(), "bf16", fp32_outputs=True)
    ids = torch.arange(3)
    out = model(torch.randn(2, 4), ids=ids)
    assert out["y"].dtype == torch.float32
    assert type(out["pair"]).__name__ == "Pair" and out["pair"].b.dtype == torch.float32
    assert out["list"][0].dtype == torch.float32 and out["ids"] is ids  # integers untouched
    plain = amp.cast_model(Multi(), "bf16")
    assert plain(torch.randn(2, 4), ids=ids)["y"].dtype == torch.bfloat16


def test_keep_fp32_by_name_pattern_callable_and_none():
    model = amp.cast_model(Net(), "bf16", keep_fp32=["fc2", "pro*"])
    d = _dtypes(model)
    assert d["fc2.weight"] == d["probe.weight"] == torch.float32
    assert d["ln.weight"] == d["fc1.weight"] == torch.bfloat16
    model(torch.randn(3, 8))  # islands by name work like islands by type
    assert model.probe.seen[-1][0] == torch.float32
    model = amp.cast_model(Net(), "fp16", keep_fp32=lambda name, m: name == "fc1")
    assert _dtypes(model)["fc1.weight"] == torch.float32 and _dtypes(model)["ln.weight"] == torch.float16
    model = amp.cast_model(Net(), "bf16", keep_fp32=())
    assert set(_dtypes(model).values()) == {torch.bfloat16}
    with pytest.raises(TypeError):
        amp.cast_model(Net(), "bf16", keep_fp32=[3])
    with pytest.raises(ValueError):
        amp.cast_model(Net(), "int8")


def test_nested_islands_and_recast_do_not_stack_hooks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)))
    amp.cast_model(model, "bf16", keep_fp32=["1", nn.LayerNorm])
    assert model._mpfused_amp.fp32_modules == ("1",)  # the LayerNorm is inside island "1"
    assert model[1][1].weight.dtype == torch.float32
    amp.cast_model(model, "bf16", keep_fp32=["1"])
    assert len(model[1]._forward_pre_hooks) == 1 and len(model[1]._forward_hooks) == 1
    assert len(model._forward_pre_hooks) == 1
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    # back to fp32: no islands, no hooks
    amp.cast_model(model, "fp32")
    assert set(_dtypes(model).values()) == {torch.float32} and not model[1]._forward_hooks


def test_island_under_autocast_runs_fp32_and_restores_state():
    model = amp.cast_model(Net(), "bf16", keep_fp32=(amp.is_norm_layer, "probe"))
    with amp.autocast(model):
        out = model(torch.randn(4, 8))
        assert torch.is_autocast_enabled("cpu")
    assert model.probe.seen[-1] == (torch.float32, torch.float32, False)
    assert model.after.seen[-1][2] is True
    assert out.dtype == torch.bfloat16

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")
    bad = amp.cast_model(nn.Sequential(nn.Linear(2, 2), Boom()), "bf16", keep_fp32=[Boom])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            bad(torch.randn(1, 2))
        assert torch.is_autocast_enabled("cpu")  # the island's post hook restored it


def test_cast_model_copy_and_pickle():
    model = amp.cast_model(Net(), "bf16", fp32_outputs=True)
    clone = copy.deepcopy(model)
    assert clone(torch.randn(2, 8)).dtype == torch.float32
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.ln.weight.dtype == torch.float32
    assert loaded(torch.randn(2, 8)).dtype == torch.float32


def test_cast_model_embedding_inputs_untouched():
    model = amp.cast_model(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
                           "bf16", fp32_outputs=True)
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.float32 and out.shape == (1, 3, 2)


# ---- setup and autocast ------------------------------------------------------------------------
def _regression(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 3, generator=g)
    return x, x @ w


def _mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))


def _train(model, opt, scaler, steps=30, accum=2, clip=None):
    x, y = _regression()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
            with amp.autocast(model):
                loss = F.mse_loss(model(xb).float(), yb) / accum
            scaler.scale(loss).backward()
            total += loss.item()
        if clip is not None:
            scaler.unscale_(opt)
            mpfused.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        losses.append(total)
    return losses


def test_setup_cpu_defaults_to_bf16_without_scaler():
    model, opt, scaler = amp.setup(_mlp(), lr=1e-2)
    assert isinstance(opt, mpfused.AdamW) and isinstance(scaler, mpfused.GradScaler)
    assert not scaler.is_enabled()
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert opt.param_groups[0]["master_weights"] == "fp32"
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 1e-2
    losses = _train(model, opt, scaler, clip=1.0)
    assert losses[-1] < 0.5 * losses[0]
    assert opt.state[model[0].weight]["master"].dtype == torch.float32
    assert "master" not in opt.state[model[1].weight]  # fp32 island: no master needed


def test_setup_fp16_enables_the_scaler(monkeypatch):
    monkeypatch.setattr(amp, "bf16_supported", lambda device: False)  # a pre-Ampere GPU, say
    model, opt, scaler = amp.setup(_mlp(), dtype="auto", lr=1e-2, max_grad_norm=1.0)
    assert model[0].weight.dtype == torch.float16 and scaler.is_enabled()
    assert opt.max_grad_norm == 1.0
    losses = _train(model, opt, scaler)
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="remainder"):
        amp.setup(_mlp(), dtype="auto", master_weights="remainder")


@pytest.mark.parametrize("recipe", [
    dict(master_weights="remainder"), dict(master_weights="none"), dict(dtype="fp32"),
    pytest.param(dict(optimizer="adamw8bit", min_8bit_size=64),
                 marks=pytest.mark.skipif(not HAS_8BIT, reason="mpfused.AdamW8bit not built yet")),
], ids=["remainder", "no-master", "fp32", "8bit"])
def test_setup_recipes_train(recipe):
    model, opt, scaler = amp.setup(_mlp(), lr=1e-2, **recipe)
    if recipe.get("dtype") == "fp32":
        assert model[0].weight.dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")
        with amp.autocast(model):
            assert not torch.is_autocast_enabled("cpu")
    losses = _train(model, opt, scaler)
    assert losses[-1] < 0.5 * losses[0]


def test_setup_errors_and_optimizer_class():
    with pytest.raises(ValueError, match="optimizer"):
        amp.setup(_mlp(), optimizer="rmsprop")
    model, opt, _ = amp.setup(_mlp(), optimizer=mpfused.Adam, weight_decay=0.0)
    assert type(opt) is mpfused.Adam
    if not HAS_8BIT:
        with pytest.raises(ImportError, match="AdamW8bit"):
            amp.setup(_mlp(), optimizer="adamw8bit")


@pytest.fixture
def restore_tf32():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]


def test_setup_tf32(restore_tf32):
    torch.set_float32_matmul_precision("highest")
    amp.setup(_mlp(), tf32=False)
    assert torch.get_float32_matmul_precision() == "highest"
    amp.setup(_mlp(), tf32=True)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_autocast_helper_picks_device_and_dtype(monkeypatch):
    ctx = amp.autocast("cpu")
    assert ctx.device == "cpu" and ctx.fast_dtype == torch.bfloat16
    ctx = amp.autocast(torch.device("cpu"), dtype="fp16")
    assert ctx.fast_dtype == torch.float16
    model = amp.cast_model(_mlp(), "fp16")
    ctx = amp.autocast(model)
    assert ctx.device == "cpu" and ctx.fast_dtype == torch.float16
    with amp.autocast(model):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert amp.autocast(_mlp()).fast_dtype == torch.bfloat16  # uncast fp32 model: device default
    monkeypatch.setattr(amp, "bf16_supported", lambda device: False)
    assert amp.autocast("cpu").fast_dtype == torch.float16
    assert amp.resolve_dtype("auto", "cpu") == torch.float16
    assert amp.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16


def test_bf16_supported_asks_the_given_gpu(monkeypatch):
    # a host with a V100 (cuda:0, current) and an A100 (cuda:1)
    caps = {0: (7, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: caps[0 if d is None or torch.device(d).index is None
                                            else torch.device(d).index])
    assert amp.bf16_supported("cuda:1") and not amp.bf16_supported("cuda:0")
    assert not amp.bf16_supported("cuda")


def test_bf16_supported():
    assert amp.bf16_supported("cpu")
    if not torch.cuda.is_available():
        assert not amp.bf16_supported("cuda")


@pytest.mark.parametrize("name,cls", [("sgd", "SGD"), ("lion", "Lion")])
def test_setup_builds_sgd_and_lion(name, cls):
    model, opt, _ = mpfused.amp.setup(torch.nn.Linear(8, 8), optimizer=name, dtype="bf16",
                                      lr=1e-3, master_weights="remainder")
    assert type(opt) is getattr(mpfused, cls) and opt.defaults["master_weights"] == "remainder"
    assert model.weight.dtype == torch.bfloat16
