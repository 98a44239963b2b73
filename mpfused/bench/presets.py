"""Model and run sizes selectable with --size.

`tiny` keeps the test fast, `small` is the CPU default (all recipes in about two minutes on two
cores), `medium` is the CUDA default: big enough (~11M params) that the optimizer step shows."""
from dataclasses import dataclass


@dataclass(frozen=True)
class SizePreset:
    n_layer: int
    n_head: int
    d_model: int
    context_length: int
    batch_size: int
    steps: int          # default number of training steps per recipe
    lr: float


SIZE_PRESETS = {
    "tiny": SizePreset(n_layer=2, n_head=2, d_model=64, context_length=32, batch_size=8,
                       steps=40, lr=3e-3),
    "small": SizePreset(n_layer=3, n_head=4, d_model=128, context_length=64, batch_size=32,
                        steps=150, lr=2e-3),
    "medium": SizePreset(n_layer=6, n_head=6, d_model=384, context_length=256, batch_size=64,
                         steps=400, lr=1e-3),
}


def default_size(device_type):
    return "medium" if device_type == "cuda" else "small"
