"""mpfused.amp.estimate_memory: the per-param table, the estimate against the measured allocation,
per optimizer (moved from tests/test_recipes.py)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpfused import amp
from tests.test_recipes import HAS_8BIT, _one_thread  # noqa: F401  (autouse: one thread)


# ---- estimate_memory -------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,expected", [
    ("native", (4, 4, 0, 8, 16)), ("master", (2, 2, 4, 8, 16)), ("remainder", (2, 2, 2, 8, 14)),
    ("no-master", (2, 2, 0, 8, 12)), ("8bit", (2, 2, 4, 2.03125, 10.03125)),
    ("8bit-remainder", (2, 2, 2, 2.03125, 8.03125)),
])
def test_estimate_per_param_table(recipe, expected):
    est = amp.estimate_memory(1_000_000, recipe=recipe)
    got = est.per_param()
    assert tuple(got.values()) == pytest.approx(expected, rel=1e-6)
    assert est.total == pytest.approx(expected[-1] * 1e6, rel=1e-6)
    text = str(est)
    assert recipe in text and "B/param" in text and "total" in text and "1,000,000" in text
    assert amp.estimate_memory(7_000_000_000, "8bit").bytes_per_param == pytest.approx(10.03125)
    with pytest.raises(ValueError, match="recipe"):
        amp.estimate_memory(10, "fp8")


class TinyLM(nn.Module):
    """Embedding tied to the head (one storage), 8-bit-sized and small params, a norm island."""

    def __init__(self, vocab=64, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.proj(F.gelu(self.fc(h))) + 0 * self.frozen(h)
        return self.head(self.norm(h))


def _measured_bytes(model, optimizer):
    """Bytes of params, grads and optimizer.state, each storage counted once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                total += s.nbytes()
    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return total


MEASURED_RECIPES = {
    "native": None,
    "master": dict(master_weights="fp32"),
    "remainder": dict(master_weights="remainder"),
    "remainder8": dict(master_weights="remainder8"),
    "no-master": dict(master_weights="none"),
    "8bit": dict(optimizer="adamw8bit", master_weights="fp32"),
    "8bit-remainder": dict(optimizer="adamw8bit", master_weights="remainder"),
    "8bit-remainder8": dict(optimizer="adamw8bit", master_weights="remainder8"),
    "8bit-no-master": dict(optimizer="adamw8bit", master_weights="none"),
}


@pytest.mark.parametrize("recipe", list(MEASURED_RECIPES))
def test_estimate_matches_measured_allocation(recipe):
    kwargs = MEASURED_RECIPES[recipe]
    if kwargs and kwargs.get("optimizer") == "adamw8bit" and not HAS_8BIT:
        pytest.skip("mpfused.AdamW8bit not built yet")
    model = TinyLM()
    estimate_before = amp.estimate_memory(model, recipe)  # from the fp32 model and keep_fp32
    if kwargs is None:  # torch.amp: fp32 weights, torch AdamW, autocast
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model, opt, _ = amp.setup(model, dtype="bf16", lr=1e-3, **kwargs)
    ids = torch.randint(0, 64, (2, 16))
    with amp.autocast(model):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    loss.backward()
    opt.step()
    measured = _measured_bytes(model, opt)
    estimate = amp.estimate_memory(model, recipe)  # from the cast model's dtypes
    assert estimate == estimate_before
    assert estimate.total == measured, f"{recipe}: estimated {estimate.total}, measured {measured}\n{estimate}"
    # The ideal per-param figure is close for a model this small already.
    ideal = amp.estimate_memory(estimate.num_params, recipe).bytes_per_param
    assert estimate.bytes_per_param == pytest.approx(ideal, rel=0.25)


def test_estimate_memory_per_optimizer():
    """SGD (momentum) and Lion keep one state tensor: half of Adam's state bytes."""
    from mpfused.amp import estimate_memory
    n = 1 << 20
    adam = estimate_memory(n, "8bit-remainder-release")
    lion = estimate_memory(n, "8bit-remainder-release", optimizer="lion")
    assert lion.optimizer_state * 2 == adam.optimizer_state
    assert lion.bytes_per_param < 5.1  # 2 weights + 2 remainder + ~1.02 state, no grads
    sgd = estimate_memory(torch.nn.Linear(256, 64), "master", optimizer="sgd")
    assert sgd.optimizer_state == 4 * (256 * 64 + 64) + 2 * 4  # fp32 buffer + step counters
    assert "sgd state" in sgd.description
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory(n, "master", optimizer="rmsprop")
