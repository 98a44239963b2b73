"""All mpfused ops. Importing this package defines every schema, then loads the native
extension so its CPU/CUDA kernels attach to those schemas."""
from mpfused.ops import adam, adam4bit, adam8bit, amp, lion, lion8bit, sgd, sgd8bit  # noqa: F401  (schemas)
from mpfused.ops.registry import BACKENDS, OPS, Op, requested_backend  # noqa: F401
from mpfused import _extension

_extension.load()
