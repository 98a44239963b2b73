"""The optimizer families the main job compares (``--optimizer adamw|sgd|lion``): for each, the
class every recipe builds and the hyperparameters it takes.

The presets' learning rates are AdamW's. SGD + momentum and Lion train the same model with their
own customary scale (Lion's authors: 3-10x smaller lr than AdamW, larger decoupled decay; SGD:
a much larger lr), so each family multiplies the preset's lr by its factor. Torch has no Lion:
the fp32 "native" Lion is ``TorchLion`` below, lion-pytorch's update in torch foreach ops."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class TorchLion(torch.optim.Optimizer):
    """Lion in plain torch ops (lion-pytorch's formula): p *= 1 - lr*wd;
    p -= lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g. The fp32-weights baseline of the Lion
    recipes; GradScaler unscales for it as for any torch optimizer."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            torch._foreach_mul_(params, 1 - lr * wd)
            c = torch._foreach_add(torch._foreach_mul(ms, b1), grads, alpha=1 - b1)
            torch._foreach_add_(params, torch._foreach_sign(c), alpha=-lr)
            torch._foreach_mul_(ms, b2)
            torch._foreach_add_(ms, grads, alpha=1 - b2)
        return loss


@dataclass(frozen=True)
class Family:
    torch_class: object      # the fp32 "native" optimizer: a class, or a "module:Name" of a peer
    mpfused: str             # mpfused class with 32-bit state
    mpfused_8bit: str        # mpfused class with 8-bit state
    bnb: str | None          # bitsandbytes.optim class (8-bit state), None: none
    torchao: str | None      # torchao.optim class (8-bit state), None: none
    lr_factor: float         # times the preset's (AdamW) lr

    def kwargs(self, hp) -> dict:
        lr = hp.lr * self.lr_factor
        if self is FAMILIES["sgd"]:
            return dict(lr=lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if self is FAMILIES["lion"]:  # decoupled decay scaled up as lr is scaled down
            return dict(lr=lr, betas=hp.betas, weight_decay=hp.weight_decay / self.lr_factor)
        return dict(lr=lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)


FAMILIES = {
    "adamw": Family(torch.optim.AdamW, "AdamW", "AdamW8bit", "AdamW8bit", "AdamW8bit", 1.0),
    "sgd": Family(torch.optim.SGD, "SGD", "SGD8bit", "SGD8bit", None, 30.0),
    "lion": Family(TorchLion, "Lion", "Lion8bit", "Lion8bit", None, 1.0 / 3.0),
}
