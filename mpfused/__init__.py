"""mpfused: fused mixed-precision training kernels for PyTorch.

Drop-ins: ``mpfused.GradScaler`` for ``torch.amp.GradScaler`` and ``mpfused.AdamW`` for
``torch.optim.AdamW`` (fp16/bf16 params with fp32 master weights)."""
from mpfused import ops  # noqa: F401  (defines the ops and loads the extension)

__version__ = "0.1.0"
