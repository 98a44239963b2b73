"""mpfused: fused mixed-precision training kernels for PyTorch.

Drop-ins: ``mpfused.GradScaler`` for ``torch.amp.GradScaler``, ``mpfused.AdamW`` / ``mpfused.Adam``
for ``torch.optim.AdamW`` / ``Adam`` (fp16/bf16 params with fp32 master weights)."""
from mpfused import ops  # noqa: F401  (defines the ops and loads the extension)
from mpfused import amp  # noqa: F401  (recipes: cast_model, setup, autocast, estimate_memory)
from mpfused.clip_grad import clip_grad_norm_
from mpfused.grad_scaler import GradScaler
from mpfused.optim import (SGD, Adam, Adam4bit, Adam8bit, AdamW, AdamW4bit, AdamW8bit, GradRelease,
                           Lion, Lion4bit, Lion8bit,
                           SGD4bit, SGD8bit, keep_32bit_state, step_in_backward)

__all__ = ["GradScaler", "AdamW", "Adam", "AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "SGD",
           "Lion", "SGD8bit",
           "Lion8bit", "SGD4bit", "Lion4bit", "clip_grad_norm_", "keep_32bit_state", "step_in_backward", "GradRelease"]
__version__ = "0.1.0"
