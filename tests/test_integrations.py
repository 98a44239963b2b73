"""mpfused optimizers inside the ecosystem's trainers, on CPU with tiny models built from configs
(no hub downloads): Hugging Face Trainer, Accelerate, Lightning. Each trains a few steps, then
checkpoints and resumes (the optimizer state_dict round trip). Skipped when a library is missing."""
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import mpfused  # noqa: E402
from mpfused import amp  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: intra-op threads only add contention on a loaded 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _changed(before, model):
    return all(not torch.equal(before[n], p.detach().float()) for n, p in model.named_parameters()
               if p.requires_grad)


def _assert_state_equal(a, b):
    """Two optimizer state_dicts are equal (tensors bit-equal, same dtypes)."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        sa, sb = a["state"][pid], b["state"][pid]
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert sa[key].dtype == sb[key].dtype, (pid, key)
                assert torch.equal(sa[key].cpu(), sb[key].cpu()), (pid, key)
            else:
                assert sa[key] == sb[key], (pid, key)


def _steps(optimizer):
    return {int(s["step"]) for s in optimizer.state.values()}


# ---- Hugging Face transformers.Trainer -------------------------------------------------------
class _CountingData(torch.utils.data.Dataset):
    """Sequences (s, s+1, s+2, ...) mod vocab: next-token prediction a tiny model learns fast."""

    def __init__(self, n=64, length=16, vocab=32):
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_llama(transformers):
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("recipe", ["fp32-autocast", "bf16-cast"])
def test_hf_trainer(tmp_path, recipe):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def build(max_steps):
        model = _tiny_llama(transformers)
        if recipe == "bf16-cast":  # bf16 weights, LlamaRMSNorm kept fp32, fp32 masters
            amp.cast_model(model, "bf16")
        opt = mpfused.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = transformers.get_linear_schedule_with_warmup(opt, 2, 8)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=16,
            use_cpu=True, bf16=recipe == "fp32-autocast", max_grad_norm=1.0,
            logging_steps=1, save_strategy="steps", save_steps=6, report_to="none",
            disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_CountingData(),
                                       optimizers=(opt, sched))
        return model, opt, trainer

    model, opt, trainer = build(6)
    before = _params(model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    assert losses[-1] < losses[0]
    assert _changed(before, model)
    assert _steps(opt) == {6}
    if recipe == "bf16-cast":
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.model.norm.weight.dtype == torch.float32
        assert all(s["master"].dtype == torch.float32 for p, s in opt.state.items()
                   if p.dtype == torch.bfloat16)
    saved = opt.state_dict()

    # the checkpoint's optimizer.pt loads back into a fresh mpfused.AdamW bit-exactly
    ckpt = tmp_path / "checkpoint-6"
    fresh_model = _tiny_llama(transformers)
    if recipe == "bf16-cast":
        amp.cast_model(fresh_model, "bf16")
    fresh = mpfused.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    _assert_state_equal(fresh.state_dict(), saved)

    # and Trainer resumes from it: step counters continue from 6
    model2, opt2, trainer2 = build(8)
    trainer2.train(resume_from_checkpoint=str(ckpt))
    assert trainer2.state.global_step == 8
    assert _steps(opt2) == {8}


# ---- Accelerate ------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))


def _regression(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 3, generator=g)


def _accelerator(accelerate, mixed_precision):
    try:
        return accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)
    except (ValueError, RuntimeError) as exc:  # fp16 on CPU, depending on the version
        pytest.skip(f"accelerate refuses mixed_precision={mixed_precision!r} on CPU: {exc}")


@pytest.mark.parametrize("mixed_precision,recipe", [
    ("bf16", "fp32"), ("bf16", "setup-bf16"), ("fp16", "fp32"), ("no", "setup-fp16")],
    ids=["bf16-autocast", "bf16-setup", "fp16-autocast", "fp16-setup-own-scaler"])
def test_accelerate_prepare(tmp_path, mixed_precision, recipe):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = _accelerator(accelerate, mixed_precision)
    if mixed_precision == "fp16" and not acc.native_amp:
        # accelerate (1.x) accepts fp16 on CPU but then trains in fp32: no autocast, no scaler
        pytest.skip("accelerate does no fp16 mixed precision on CPU")
    scaler = None
    if recipe == "fp32":
        model = _mlp()
        opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    else:  # 16-bit weights + fp32 masters from mpfused.amp.setup
        model, opt, scaler = amp.setup(_mlp(), dtype=recipe[-4:], lr=1e-2)
        assert scaler.is_enabled() == (recipe == "setup-fp16")
        acc.register_for_checkpointing(scaler)
    x, y = _regression()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model, opt, loader = acc.prepare(model, opt, loader)
    before = _params(model)

    def epoch():
        losses = []
        for xb, yb in loader:
            opt.zero_grad()
            if recipe == "setup-fp16":  # accelerate's AMP is off: mpfused's scaler and autocast
                with amp.autocast(model):
                    loss = F.mse_loss(model(xb).float(), yb)
                acc.backward(scaler.scale(loss))
                # The inner optimizer: accelerate's wrapper hides `_step_supports_amp_scaling`,
                # so the scaler would take torch's unscale_ path, which refuses fp16 grads.
                scaler.step(opt.optimizer)  # unscale + skip-on-inf in the optimizer kernel
                scaler.update()
            else:
                loss = F.mse_loss(model(xb).float(), yb)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            losses.append(loss.item())
        return losses

    losses = epoch() + epoch() + epoch()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4])
    assert _changed(before, model)
    assert (acc.scaler is not None) == (mixed_precision == "fp16")

    acc.save_state(str(tmp_path / "ckpt"))
    saved = copy.deepcopy(opt.state_dict())
    scalers = [s for s in (acc.scaler, scaler) if s is not None and s.is_enabled()]
    scaler_saved = [s.state_dict() for s in scalers]
    epoch()
    acc.load_state(str(tmp_path / "ckpt"))
    _assert_state_equal(opt.state_dict(), saved)
    assert [s.state_dict() for s in scalers] == scaler_saved
    assert all(torch.isfinite(torch.tensor(epoch())))
    AcceleratorState._reset_state(reset_partial_state=True)


# ---- Lightning -------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lightning_configure_optimizers(tmp_path, precision):
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.losses = []

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = F.mse_loss(self.net(xb).float(), yb.float())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            # Clip in the optimizer: Lightning's AMP plugin refuses `gradient_clip_val` for
            # optimizers that unscale internally (`_step_supports_amp_scaling`).
            return mpfused.AdamW(self.parameters(), lr=1e-2, max_grad_norm=1.0)

    def trainer(max_steps):
        return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(tmp_path))

    x, y = _regression()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    module = Module()
    before = _params(module)
    t = trainer(12)
    t.fit(module, loader)
    opt = t.optimizers[0]
    assert isinstance(opt, mpfused.AdamW) and _steps(opt) == {12}
    assert all(torch.isfinite(torch.tensor(module.losses)))
    assert sum(module.losses[-4:]) < sum(module.losses[:4])
    assert _changed(before, module)
    if precision == "bf16-true":  # Lightning casts the module: the optimizer keeps fp32 masters
        assert module.net[0].weight.dtype == torch.bfloat16
        assert all(s["master"].dtype == torch.float32 for s in opt.state.values())
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(str(path))
    saved = copy.deepcopy(opt.state_dict())

    resumed = Module()
    t2 = trainer(14)
    t2.fit(resumed, loader, ckpt_path=str(path))
    opt2 = t2.optimizers[0]
    assert _steps(opt2) == {14}
    reloaded = mpfused.AdamW(Module().to(next(resumed.parameters()).dtype).parameters(), lr=1e-2,
                             max_grad_norm=1.0)
    reloaded.load_state_dict(torch.load(path, weights_only=False)["optimizer_states"][0])
    _assert_state_equal(reloaded.state_dict(), saved)
