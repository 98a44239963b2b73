"""The 2-process runs behind tests/test_release_fsdp.py: gradient release under FSDP2
(``mpfused.step_in_backward(opt, fsdp=model)``) against the ordinary FSDP2 step, one gloo launch
(``python -m tests.distributed_release_fsdp_runs all RANK WORLD DIR``; ``results()`` runs it once
per pytest process). Model, data and wrapping are tests/distributed_model.py's, the launcher
tests/distributed_harness.py's.

The model's three Linear layers are fully_shard'ed one by one (the root holds no param): three
FSDP param groups, i.e. three release buckets (fc3, fc2, fc1 in backward order). The optimizer
has two param groups (weights; biases without decay), so every FSDP bucket spans both.

Each config trains STEPS steps twice on every rank: the ordinary FSDP2 step and release. At
NAN_STEP a hook registered on the sharded fc2.weight before release attaches writes a NaN into
rank 1's local shard of its grad (FSDP2 fires it after the reduce-scatter, just before release's
hook). The rule under test: the fc2 bucket (fc2.weight and fc2.bias) is skipped on both ranks,
fc1 and fc3 step, the scale backs off. The ordinary run's counterpart of that step (the
reference, public API only): fc2's grads are dropped (set to None: the ordinary step leaves those
params, state and step counts untouched) and a second, dummy optimizer whose one grad is NaN is
stepped by the same scaler, so ``update()`` backs off.

clip='previous' runs (CLIP_CONFIGS: FSDP2 and HSDP 2x1) train ClipNet, whose FSDP groups are
the buckets the single-process release makes with CLIP_BUCKET_BYTES; the test compares them with
that single-process run (tests/test_release_fsdp.py computes it in the pytest process: release
without ddp=/fsdp= is refused on several ranks) and the ranks with each other; the same NaN rule.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile

import torch

from tests.distributed_harness import _launch, join_group, run_jobs
from tests.distributed_model import _wrap, batch, loss_fn, make_model, make_scaler

STEPS = 10
NAN_STEP = 4
ACCUM_STEPS = 4
CKPT_STEPS, CKPT_AT = 6, 3
# name: (mesh shape, param dtype, optimizer, optimizer kwargs)
CONFIGS = {
    "fp32": ((2,), "float32", "AdamW", {}),
    "bf16_remainder": ((2,), "bfloat16", "AdamW", dict(master_weights="remainder")),
    "bf16_fp32_master": ((2,), "bfloat16", "AdamW", dict(master_weights="fp32")),
    "adamw8bit": ((2,), "float32", "AdamW8bit", {}),
    "sgd_bf16_stochastic": ((2,), "bfloat16", "SGD", dict(master_weights="none")),
    # HSDP, shard dim of size 1: rank 1's NaN reaches rank 0 only through the Replicate dim
    "hsdp_2x1": ((2, 1), "float32", "AdamW", {}),
}
ACCUM = {"fp32": "accumulate", "bf16_remainder": "no_sync"}  # config: how micro-batches accumulate
# clip='previous' (ClipNet, fp32, one param group, max_grad_norm=MAX_NORM): name -> (mesh, opt)
CLIP_CONFIGS = {"clip_fsdp": ((2,), "AdamW"), "clip_hsdp_2x1": ((2, 1), "SGD")}
MAX_NORM = 0.3  # the step's grad norm is 0.4-0.9 here: every bucket clips, by varying amounts
CKPT = ["bf16_remainder", "adamw8bit", "clip_fsdp"]
BUCKET_OF_NAN = ("fc2.weight", "fc2.bias")


class _GainLinear(torch.nn.Linear):
    """A Linear whose output is multiplied by ``gain`` (1 x out_features), a param of the same
    module (so of its FSDP group, unsharded in its forward)."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(1, n_out))

    def forward(self, x):
        return super().forward(x) * self.gain


class ClipNet(torch.nn.Module):
    """The clip='previous' runs' model: three layers of 119, 120 and 119 elements (all sharded
    unevenly over 2 ranks: 4 + 3, 8 + 7, 4 + 3 rows), so that the single-process release with
    CLIP_BUCKET_BYTES (one param group) makes the same buckets as FSDP2's groups: fc3, fc2, fc1
    (each layer fits, no layer plus the next one's bias does). fc3 also holds ``gain`` (1 x 7,
    _GainLinear): FSDP2 shards its one row to rank 0, rank 1's shard is empty (0 x 7), so the
    fc3 bucket has empty and non-empty local grads on rank 1."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 7)
        self.fc2 = torch.nn.Linear(7, 15)
        self.fc3 = _GainLinear(15, 7)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


CLIP_BUCKET_BYTES = 120 * 4


def make_clip_model(seed: int = 0) -> ClipNet:
    torch.manual_seed(seed)
    return ClipNet()


def make_clip_optim(params, opt: str):
    import mpfused

    if opt == "SGD":
        return mpfused.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1, max_grad_norm=MAX_NORM)
    return mpfused.AdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=MAX_NORM)


def _data(step, rank, dtype, micro=0):
    return batch(100 + 2 * step + micro, rank, dtype)  # (test_distributed's INF_STEP never hit)


def make_optim(model, opt: str, kw: dict):
    import mpfused

    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    if opt == "SGD":
        return mpfused.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.1, **kw)
    cls = mpfused.AdamW8bit if opt == "AdamW8bit" else mpfused.AdamW
    return cls(groups, lr=1e-2, weight_decay=0.1, **kw)


def _local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def local_params(model):
    return {n: _local(p) for n, p in model.named_parameters()}


def local_state(model, opt):
    return {n: {k: _local(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()}


class Run:
    """One FSDP2 training run of a config on this rank: ordinary step or release."""

    def __init__(self, name, rank, release: bool, seed: int = 0):
        clip = name in CLIP_CONFIGS
        if clip:
            (mesh, opt_name), dtype = CLIP_CONFIGS[name], "float32"
            self.model = _wrap(make_clip_model(seed), "fsdp", mesh)
            self.opt = make_clip_optim(self.model.parameters(), opt_name)
        else:
            mesh, dtype, opt_name, kw = CONFIGS[name]
            self.model = _wrap(make_model(dtype, seed), "fsdp", mesh)
            self.opt = make_optim(self.model, opt_name, kw)
        self.rank, self.dtype, self.release = rank, dtype, release
        self.scaler = make_scaler()
        self.inject = False
        self.model.fc2.weight.register_post_accumulate_grad_hook(self._inject)
        self.handle = None
        if release:
            import mpfused

            self.handle = mpfused.step_in_backward(self.opt, scaler=self.scaler, fsdp=self.model,
                                                   clip="previous" if clip else None)

    def _inject(self, p):
        if self.inject and self.rank == 1:
            p.grad.to_local()[0, 0] = float("nan")

    def step(self, step, nan=False, accum=None):
        import mpfused

        model, opt, scaler = self.model, self.opt, self.scaler
        opt.zero_grad(set_to_none=True)
        micro = [_data(step, self.rank, self.dtype, m) for m in range(2 if accum else 1)]
        for m, (x, y) in enumerate(micro):
            last = m == len(micro) - 1
            if accum == "no_sync":
                model.set_requires_gradient_sync(last)
            with (self.handle.accumulate() if accum == "accumulate" and not last
                  and self.handle is not None else _null()):
                self.inject = nan and self.release
                scaler.scale(loss_fn(model, x, y)).backward()
                self.inject = False
        skipped = None if self.handle is None else int(self.handle.skipped)
        self.grads_left = sum(p.grad is not None for p in model.parameters())
        dummy = None
        if nan and not self.release:  # the reference of the release rule (module docstring)
            for pname in BUCKET_OF_NAN:
                model.get_parameter(pname).grad = None
            w = torch.zeros(3, requires_grad=True)
            w.grad = torch.full((3,), float("nan"))
            dummy = mpfused.SGD([w], lr=0.0)
        scaler.step(opt)
        if dummy is not None:
            scaler.step(dummy)
        scaler.update()
        return skipped

    def snapshot(self):
        out = dict(params=local_params(self.model), state=local_state(self.model, self.opt),
                   scale=self.scaler.get_scale())
        if self.handle is not None and self.handle.clip:
            out["clip_sq"] = self.handle.state_dict()["clip_sq_per_param"].clone()
        return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _equal_runs(name, rank):
    """Ordinary and release runs of STEPS steps, NaN on rank 1's fc2 shard at NAN_STEP."""
    out = {}
    for kind in ("ordinary", "release"):
        run = Run(name, rank, release=kind == "release")
        traj, skipped, grads_left = [], [], []
        for step in range(STEPS):
            skipped.append(run.step(step, nan=step == NAN_STEP))
            grads_left.append(run.grads_left)
            traj.append(local_params(run.model) | {"_scale": run.scaler.get_scale()})
        out[kind] = dict(traj=traj, skipped=skipped, grads_left=grads_left, final=run.snapshot())
    return out


def _accumulation(name, rank):
    out = {}
    for kind in ("ordinary", "release"):
        run = Run(name, rank, release=kind == "release")
        for step in range(ACCUM_STEPS):
            run.step(step, accum=ACCUM[name])
        out[kind] = run.snapshot()
    return out


def _clip_run(name, rank):
    """clip='previous' release, STEPS steps, NaN on rank 1's fc2 shard at NAN_STEP: per step the
    full params, the per-param sums carried (release.state_dict()) and the skipped count; the
    final local snapshot (HSDP: the replicas must agree bit for bit); the params whose local
    shard is empty here."""
    from tests.distributed_model import full

    run = Run(name, rank, release=True)
    traj = []
    for step in range(STEPS):
        skipped = run.step(step, nan=step == NAN_STEP)
        traj.append(dict(params={n: full(p) for n, p in run.model.named_parameters()},
                         clip_sq=run.handle.state_dict()["clip_sq_per_param"].clone(),
                         skipped=skipped, scale=run.scaler.get_scale()))
    empty = [n for n, p in run.model.named_parameters() if p.to_local().numel() == 0]
    return dict(traj=traj, final=run.snapshot(), empty_shards=empty)


def _checkpoint(name, rank, ckpt_dir):
    """Release run of CKPT_STEPS steps with a DCP save after CKPT_AT; a fresh model, optimizer,
    scaler and release (seed 123) load it and train the rest. With clip='previous' the release
    handle (Stateful: the previous step's global per-param sums) is saved and loaded too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run = Run(name, rank, release=True)
    for step in range(CKPT_STEPS):
        if step == CKPT_AT:
            msd, osd = get_state_dict(run.model, run.opt)
            sd = {"model": msd, "optim": osd, "scaler": run.scaler.state_dict()}
            if run.handle.clip:
                sd["release"] = run.handle
            dcp.save(sd, checkpoint_id=ckpt_dir)
        run.step(step)
    out = {"uninterrupted": run.snapshot()}
    run2 = Run(name, rank, release=True, seed=123)
    msd, osd = get_state_dict(run2.model, run2.opt)  # (makes the state: an ordinary step, lr 0)
    sd = {"model": msd, "optim": osd, "scaler": run2.scaler.state_dict()}
    if run2.handle.clip:
        sd["release"] = run2.handle
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(run2.model, run2.opt, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    run2.scaler.load_state_dict(sd["scaler"])
    for step in range(CKPT_AT, CKPT_STEPS):
        run2.step(step)
    out["resumed"] = run2.snapshot()
    return out


def _refusals(rank):
    """The errors step_in_backward gives under FSDP2 for what it does not support."""
    import mpfused

    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))

    model = _wrap(make_model("float32"), "fsdp", (2,))
    attempt("no_fsdp", lambda: mpfused.step_in_backward(mpfused.AdamW(model.parameters())))
    extra = torch.nn.Parameter(torch.zeros(3))
    attempt("foreign_param", lambda: mpfused.step_in_backward(
        mpfused.AdamW(list(model.parameters()) + [extra]), fsdp=model))
    attempt("not_fsdp_module", lambda: mpfused.step_in_backward(
        mpfused.AdamW(model.parameters()), fsdp=torch.nn.Linear(2, 2)))
    # a param group refused after attaching (a param not under `fsdp`): release keeps its hooks
    opt = mpfused.AdamW(model.parameters(), lr=1e-2)
    mpfused.step_in_backward(opt, fsdp=model)
    attempt("add_foreign_group", lambda: opt.add_param_group({"params": [extra]}))
    before = local_params(model)
    loss_fn(model, *_data(0, rank, "float32")).backward()
    after = local_params(model)
    out["after_refused_add"] = dict(
        groups=len(opt.param_groups), grads_left=sum(p.grad is not None for p in model.parameters()),
        stepped=sorted(n for n in before if not torch.equal(before[n], after[n])))
    return out


def _worker_main(launch, rank, world, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    join_group(rank, world, out_dir)
    jobs = {("equal", n): functools.partial(_equal_runs, n, rank) for n in CONFIGS}
    jobs.update({("accum", n): functools.partial(_accumulation, n, rank) for n in ACCUM})
    jobs.update({("clip", n): functools.partial(_clip_run, n, rank) for n in CLIP_CONFIGS})
    jobs.update({("ckpt", n): functools.partial(_checkpoint, n, rank,
                                                os.path.join(out_dir, "ckpt_" + n)) for n in CKPT})
    jobs[("refusals", "")] = functools.partial(_refusals, rank)
    run_jobs(jobs, rank, out_dir)


@functools.cache
def results():
    """Every rank's results (one launch per pytest process)."""
    with tempfile.TemporaryDirectory(prefix="mpfused-relfsdp-") as d:
        return _launch("all", d, module="tests.distributed_release_fsdp_runs")


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
