"""All mpfused ops. Importing this package defines every schema, loads the native extension so its
CPU/CUDA kernels attach to those schemas, then routes each op once (router.py): what
``torch.ops.mpfused.<op>`` runs on each device, with ``MPFUSED_BACKEND`` read at this moment."""
from mpfused.ops import (adam, adam4bit, adam8bit, amp, lion, lion4bit, lion8bit,  # noqa: F401
                         sgd, sgd4bit, sgd8bit)  # (schemas)
from mpfused.ops.registry import BACKENDS, OPS, Op  # noqa: F401
from mpfused.ops import router
from mpfused import _extension

_extension.load()
router.route_all(OPS.values())
