"""What the 2-process runs and their single-process references share: the model, the data (the
global batch of each step, split per rank, with an inf in rank 1's half at INF_STEP), the
optimizers and scaler, the engines' wrapping (DDP, FSDP2 / HSDP) and the snapshots of params and
state (DTensors as full tensors). Used by the worker modules (tests/distributed_*_runs.py) and the
tests that compare with them.
"""
from __future__ import annotations

import torch

from tests.distributed_harness import WORLD

BATCH = 4                # per rank
STEPS = 7
INF_STEP = 2             # rank 1's half-batch of this step holds an inf (every run skips it)
CKPT_AT = 3              # checkpoint after this many steps


def _has_8bit() -> bool:
    import mpfused

    return hasattr(mpfused, "AdamW8bit")


class Net(torch.nn.Module):
    # fc2.weight: 4608 elements (>= min_8bit_size 4096: 8-bit state) but 2304 per rank under
    # FSDP2, so the size rule must be judged on the global shape; 2304 = 9 blocks of 256, so the
    # per-shard blocks coincide with the unsharded ones. fc3 (7 rows) is sharded unevenly (4 + 3).
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 96)
        self.fc2 = torch.nn.Linear(96, 48)
        self.fc3 = torch.nn.Linear(48, 7)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(dtype: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(getattr(torch, dtype))


def batch(step: int, rank: int, dtype: str):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD * BATCH, 16, generator=g)
    y = torch.randn(WORLD * BATCH, 7, generator=g)
    if step == INF_STEP:
        x[BATCH, 0] = float("inf")  # in rank 1's half only
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[sl].to(getattr(torch, dtype)), y[sl]


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


def make_optim(params, opt: str, max_grad_norm, **kw):
    import mpfused

    if opt == "AdamW8bit":
        return mpfused.AdamW8bit(params, lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm,
                                 **kw)
    if opt == "SGD":
        return mpfused.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1,
                           max_grad_norm=max_grad_norm)
    if opt == "Lion":
        return mpfused.Lion(params, lr=1e-3, weight_decay=0.1, max_grad_norm=max_grad_norm)
    return mpfused.AdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm)


def make_scaler():
    import mpfused

    return mpfused.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)


def full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def state_snapshot(model, opt):
    """{param name: {state key: tensor}}: DTensor state as full tensors, plain ones as they are
    (AdamW8bit keeps its 8-bit codes/absmax of a DTensor param as plain per-shard tensors)."""
    return {n.replace("module.", ""): {k: full(v) for k, v in opt.state[p].items()}
            for n, p in model.named_parameters()}


def kinds_of(model, opt):
    """{param name: {state key: (type name, dtype, shape)}}."""
    return {n.replace("module.", ""): {k: (type(v).__name__, str(v.dtype), tuple(v.shape))
                                       for k, v in opt.state[p].items()}
            for n, p in model.named_parameters()}


def params_of(model):
    return {n.replace("module.", ""): full(p) for n, p in model.named_parameters()}


def _wrap(model, engine, mesh_shape):
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)
