"""Training-state memory, measured from the tensors themselves.

Each storage is counted once (tied weights, views into flat buffers and shared quantization maps
would otherwise be counted twice), and tensor subclasses such as torchao's 8-bit state are unwrapped
into the plain tensors that actually hold the bytes."""
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Optimizer-state keys that hold (part of) a higher-precision copy of the weights.
MASTER_KEYS = ("master", "remainder")


def _plain_tensors(obj, depth=0):
    """Plain tensors reachable from obj through containers and tensor subclasses."""
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            inner_names, _ = obj.__tensor_flatten__()
            for name in inner_names:
                yield from _plain_tensors(getattr(obj, name), depth + 1)
        else:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _plain_tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _plain_tensors(value, depth + 1)


class _StorageCounter:
    def __init__(self):
        self._seen = set()

    def bytes_of(self, obj):
        """Bytes of the storages behind obj that were not counted before."""
        total = 0
        for t in _plain_tensors(obj):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def training_state_bytes(model, optimizer, scaler):
    """Bytes per category: weights, grads, master, optimizer_state, scaler (each storage once).

    Categories are counted in that order, so a storage shared by two categories is charged to the
    first one (e.g. an optimizer that aliases the weights adds nothing)."""
    counter = _StorageCounter()
    params = list(model.parameters())
    result = {
        "weights": counter.bytes_of(params),
        "grads": counter.bytes_of([p.grad for p in params if p.grad is not None]),
        "master": 0,
        "optimizer_state": 0,
    }
    for state in optimizer.state.values():
        for key, value in state.items():
            bucket = "master" if any(k in str(key) for k in MASTER_KEYS) else "optimizer_state"
            result[bucket] += counter.bytes_of(value)
    # Tensors an optimizer keeps outside `state` (flat buffers, tensor-valued hyperparameters).
    result["optimizer_state"] += counter.bytes_of(optimizer.param_groups)
    result["optimizer_state"] += counter.bytes_of(
        [v for k, v in vars(optimizer).items() if k not in ("state", "param_groups")])
    result["scaler"] = counter.bytes_of(list(vars(scaler).values()))
    result["total"] = sum(result.values())
    return result


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device):
    """torch.cuda.max_memory_allocated since the last reset_peak_memory (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
