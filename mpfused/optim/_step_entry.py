"""The entry of ``FusedOptimizer.step``: torch's step wrapper, lean when no profiler runs.

torch wraps every optimizer's ``step`` in ``Optimizer.profile_hook_step`` (the step pre-hooks,
the step under ``record_function("Optimizer.step#<Class>.step")``, ``_optimizer_step_code``, the
post-hooks), and ``step`` itself runs under ``torch.no_grad()``. Each of these is a few Python
objects and two dispatcher ops (record_function's enter/exit) per step: ~12 us warm, but ~60 us
right after a kernel that streamed more than the caches hold (a 1M-param 8/4-bit step moves
~8 MB), about 6% of a 1M-param bf16 step on one core (issue 24). ``step_entry`` keeps torch's
wrapper where it is observable: while the autograd profiler (``torch.profiler`` / Kineto) runs,
and under ``torch.compile`` (dynamo traces torch's own wrapper, as before). Otherwise it runs the
same hooks in the same order with the same argument rewriting, and the step with grad mode off,
without the record_function and the no_grad object. The function is marked ``hooked`` so torch's
``Optimizer._patch_step_function`` leaves it as it is.

``capture_health_check``: torch's graph-capture check of a step (capturable groups while a
CUDA/XPU graph captures), which asks ``torch.accelerator.current_accelerator`` every step (~20 us
cold). It can only fire on CUDA/XPU, so a torch built with neither (the CPU wheel) skips it: the
built accelerator is asked once per process.
"""
from __future__ import annotations

import functools
from itertools import chain

import torch
from torch.optim import optimizer as _torch_optim
from torch.optim.optimizer import Optimizer

_profiler_enabled = torch._C._autograd._profiler_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled


def step_entry(func):
    """``func`` (an optimizer's undecorated step) with torch's hooks and grad mode off."""
    no_grad = torch.no_grad()(func)
    torch_path = Optimizer.profile_hook_step(no_grad)

    @functools.wraps(func)
    def step(*args, **kwargs):
        # is_compiling first: dynamo cannot trace _profiler_enabled (a torch._C call returning bool)
        if torch.compiler.is_compiling() or _profiler_enabled():
            return torch_path(*args, **kwargs)
        self = args[0]
        if _torch_optim._global_optimizer_pre_hooks or self._optimizer_step_pre_hooks:
            for pre_hook in chain(_torch_optim._global_optimizer_pre_hooks.values(),
                                  self._optimizer_step_pre_hooks.values()):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(f"{func} must return None or a tuple of "
                                           f"(new_args, new_kwargs), but got {result}.")
        prev = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            out = func(*args, **kwargs)
        finally:
            _set_grad_enabled(prev)
        if self._optimizer_step_post_hooks or _torch_optim._global_optimizer_post_hooks:
            for post_hook in chain(self._optimizer_step_post_hooks.values(),
                                   _torch_optim._global_optimizer_post_hooks.values()):
                post_hook(self, args, kwargs)
        return out

    step.hooked = True  # torch's _patch_step_function: already wrapped
    step.__wrapped__ = no_grad
    return step


_NO_GRAPH_CAPTURE = []  # [True] once known: this torch has no CUDA/XPU backend (never changes)


def capture_health_check(optimizer) -> None:
    """torch's ``_accelerator_graph_capture_health_check`` (``_cuda_graph_capture_health_check``
    on older torch), skipped where no graph can capture (and when compiling, as torch's)."""
    if torch.compiler.is_compiling():
        return
    if not _NO_GRAPH_CAPTURE:
        acc = getattr(torch, "accelerator", None)  # older torch: unknown, always check
        built = acc.current_accelerator(check_available=False) if acc is not None else False
        _NO_GRAPH_CAPTURE.append(built is None or (built is not False
                                                   and built.type not in ("cuda", "xpu")))
    if _NO_GRAPH_CAPTURE[0]:
        return
    check = getattr(optimizer, "_accelerator_graph_capture_health_check", None)
    (check or optimizer._cuda_graph_capture_health_check)()
