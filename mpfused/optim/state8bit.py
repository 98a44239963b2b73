"""``State8bit``: the 8-bit block-wise state machinery of ``AdamW8bit``, as a mixin placed before
the 32-bit optimizer in the class bases (``class AdamW8bit(State8bit, AdamW)``): which params are
8-bit, conversions between 8-bit and fp32 state, the plan split into 8-bit and fp32 buckets, the
state_dict hooks and the exports to torch and bitsandbytes. The format is described in
mpfused/optim/adamw8bit.py."""
from __future__ import annotations

import torch

from mpfused.distributed import is_dtensor
from mpfused.distributed_8bit import _like_param
from mpfused.ops import adam8bit as adam8bit_ops
from mpfused.ops.bound import BoundOp
from mpfused.optim._buckets import Bucket, GroupPlan, build_buckets
from mpfused.optim._checkpoint_8bit import (
    _BNB_BLOCK, _TORCH_GROUP_KEYS, _add_format, _check_and_stash_8bit, _check_group_8bit,
    _restore_8bit, _saved_8bit, _state_block_size, is_8bit_state)
from mpfused.optim._overrides import _kept_32bit_ids, _overrides_epoch
from mpfused.optim.engine import _local
from mpfused.quant_maps import (SIGNED_ZERO_CODE, dequantize_blockwise, num_blocks,
                                quantize_blockwise, signed_map, unsigned_map)

__all__ = ["State8bit"]


class State8bit:
    """The 8-bit state of an optimizer on the engine (a mixin: see the module docstring)."""

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, value in self._8bit_defaults.items():
            group.setdefault(key, value)
        try:
            _check_group_8bit(group)
        except ValueError as e:
            self.param_groups.pop()  # nothing of the rejected group stays (as AdamW's checks)
            raise ValueError(f"mpfused.{type(self).__name__}: {e}") from None

    def _register_hooks(self) -> None:
        super()._register_hooks()
        self.register_state_dict_post_hook(_add_format)
        self.register_load_state_dict_pre_hook(_check_and_stash_8bit, prepend=True)
        self.register_load_state_dict_post_hook(_restore_8bit)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("block_size", 256)
            group.setdefault("min_8bit_size", 4096)
            group.setdefault("optim_bits", 8)

    # ---- which params are 8-bit --------------------------------------------------------------
    def _wants_8bit(self, group, p, kept: set[int]) -> bool:
        return (group["optim_bits"] == 8 and p.numel() >= group["min_8bit_size"]  # global numel
                and getattr(p, "_mpfused_optim_bits", 8) != 32 and id(p) not in kept)

    _is_8bit_state = staticmethod(is_8bit_state)

    def _init_state(self, group, p, want_8bit: bool = False) -> None:
        state = self.state[p]
        if len(state) != 0:
            return
        if not want_8bit:
            return super()._init_state(group, p)  # step, fp32 moments
        self._master_mode(group, p)  # an invalid mode for this dtype fails before any state
        local = _local(p)
        blocks = num_blocks(local.numel(), group["block_size"])
        state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        state["exp_avg"] = torch.full(local.shape, SIGNED_ZERO_CODE, dtype=torch.uint8,
                                      device=local.device)  # codes of exact zeros
        state["exp_avg_sq"] = torch.zeros(local.shape, dtype=torch.uint8, device=local.device)
        state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        state["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        # The codes and absmax are per local shard (blocks never straddle shards); masters come
        # from AdamW._sync_state_keys, from p (a DTensor param gets DTensor masters).

    def _convert_state(self, group, p, to_8bit: bool, block: int | None = None) -> None:
        """Quantize fp32 moments (to_8bit) or dequantize codes, in place in self.state[p], with
        blocks of `block` (default: the group's)."""
        state, block = self.state[p], block or group["block_size"]
        local = _local(p)
        if to_8bit:
            for key, qmap, absmax_key in (("exp_avg", signed_map(local.device), "exp_avg_absmax"),
                                          ("exp_avg_sq", unsigned_map(local.device),
                                           "exp_avg_sq_absmax")):
                codes, absmax = quantize_blockwise(_local(state[key]), qmap, block)
                state[key], state[absmax_key] = codes.contiguous(), absmax
        else:
            state["exp_avg"] = dequantize_blockwise(state["exp_avg"], state.pop("exp_avg_absmax"),
                                                    signed_map(local.device), block)
            state["exp_avg_sq"] = dequantize_blockwise(
                state["exp_avg_sq"], state.pop("exp_avg_sq_absmax"), unsigned_map(local.device),
                block)

    def _adopt_written_state(self, p) -> None:
        """AdamW's, and moments written as floats over 8-bit state (a reset of one or both): a
        moment still in codes is dequantized and the absmax go, so _sync_form sees one form."""
        state = self.state[p]
        floats = [k for k in ("exp_avg", "exp_avg_sq")
                  if isinstance(state.get(k), torch.Tensor) and state[k].is_floating_point()]
        if floats and "exp_avg_absmax" in state:
            block = _state_block_size(state, _local(p).numel(), 256)
            for key, qmap in (("exp_avg", signed_map), ("exp_avg_sq", unsigned_map)):
                absmax = state.pop(f"{key}_absmax", None)
                if key not in floats and absmax is not None:
                    state[key] = dequantize_blockwise(state[key], absmax, qmap(_local(p).device),
                                                      block)
        super()._adopt_written_state(p)

    def _sync_form(self, group, p, want_8bit: bool) -> None:
        """Bring p's state to the form its group wants: 8-bit or fp32, and 8-bit in blocks of the
        group's block_size (after a change of it: dequantize with the old blocks, re-quantize)."""
        state = self.state[p]
        if "exp_avg" not in state:
            return
        if self._is_8bit_state(state):
            old = _state_block_size(state, _local(p).numel(), group["block_size"])
            if want_8bit and old == group["block_size"]:
                return
            self._convert_state(group, p, to_8bit=False, block=old)
        if want_8bit:
            self._convert_state(group, p, to_8bit=True)

    # ---- kernel plan: 8-bit and fp32-state params in separate buckets ---------------------------
    def _plan(self, index: int, group, grads, cache: bool = True) -> GroupPlan:
        params = group["params"]
        extra = (group["master_weights"], group["optim_bits"], group["block_size"],
                 group["min_8bit_size"], _overrides_epoch())
        plan = self._plans.get(index) if cache else None
        if plan is not None and plan.matches(params, grads, extra):
            return plan
        try:  # settings may have been changed in the group since add_param_group
            _check_group_8bit(group, f"param_groups[{index}]")
        except ValueError as e:
            raise ValueError(f"mpfused.{type(self).__name__}: {e}") from None
        kept = _kept_32bit_ids()
        buckets = []
        for b in build_buckets(params, grads):
            split: dict[bool, Bucket] = {}
            for i, p in zip(b.indices, b.params):
                want = self._wants_8bit(group, p, kept)
                self._init_state(group, p, want)
                self._adopt_written_state(p)
                self._sync_form(group, p, want)
                sub = split.setdefault(want, Bucket(indices=[], params=[]))
                sub.indices.append(i)
                sub.params.append(p)
            # fp32-state (small) params first: the 8-bit bucket's pass over memory evicts the
            # host-side code and data the next call needs (the small call costs 40 us after it,
            # 20 us warm, on the 2-core CPU).
            for want, sub in sorted(split.items(), key=lambda kv: kv[0]):
                self._fill_bucket(group, sub, want)
                buckets.append(sub)
        plan = GroupPlan.of(params, grads, extra, buckets)
        if cache:
            self._plans[index] = plan
        return plan

    def _fill_bucket(self, group, b: Bucket, eight: bool = False) -> None:
        super()._fill_bucket(group, b)
        b.state["eight"] = eight
        if eight:
            st = [self.state[p] for p in b.params]
            dev = b.state["local_params"][0].device
            b.state.update(absmax1s=[s["exp_avg_absmax"] for s in st],
                           absmax2s=[s["exp_avg_sq_absmax"] for s in st],
                           qmap1=signed_map(dev), qmap2=unsigned_map(dev))
            s = b.state
            s["step_"] = BoundOp(adam8bit_ops.adam8bit_step_, [
                s["local_params"], s["exp_avgs"], s["exp_avg_sqs"], s["absmax1s"], s["absmax2s"],
                s["masters"], s["steps"]], s["param_ids"], s["elem_offsets"])

    # ---- step: AdamW.step, with 8-bit buckets launched on the 8-bit kernel ----------------------
    def _launch(self, b, grads, group, hyper, scaling) -> None:
        s = b.state
        if not s["eight"]:
            return super()._launch(b, grads, group, hyper, scaling)
        s["step_"](grads, s["qmap1"], s["qmap2"], int(group["block_size"]), *hyper,
                   bool(group["maximize"]), bool(group["decoupled_weight_decay"]), s["mode"],
                   *scaling, backend=self._backend)

    # ---- conversions -------------------------------------------------------------------------
    def to_torch_state_dict(self) -> dict:
        """A state_dict for ``torch.optim.AdamW`` (``torch.optim.Adam`` for ``Adam8bit``):
        fp32 moments (8-bit ones dequantized), the step counters, torch's group keys. fp32
        masters have no place in a torch state_dict and are dropped."""
        self._local_8bit_state_dict = True  # the local codes are dequantized below
        try:
            sd = self.state_dict()
        finally:
            del self._local_8bit_state_dict
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        groups_of = {i: g for g in self.param_groups for i in [id(q) for q in g["params"]]}
        state = {}
        for pid, p in zip(ids, params):
            saved = sd["state"].get(pid)
            if not saved:
                continue
            saved = _saved_8bit(saved)  # the live key names
            out = {"step": saved["step"].detach().float().reshape(()).cpu().clone()}  # no alias
            block = groups_of[id(p)]["block_size"]
            for key, qmap, absmax_key in (("exp_avg", signed_map, "exp_avg_absmax"),
                                          ("exp_avg_sq", unsigned_map, "exp_avg_sq_absmax")):
                v = saved[key]
                if v.dtype == torch.uint8:  # local codes: a DTensor param gets a DTensor moment
                    m = dequantize_blockwise(_local(v), _local(saved[absmax_key]),
                                             qmap(_local(v).device), block)
                    out[key] = _like_param(m, p)
                else:
                    out[key] = v.detach().clone().float()
            state[pid] = out
        groups = []
        for g in sd["param_groups"]:
            tg = {k: g[k] for k in _TORCH_GROUP_KEYS if k in g}
            tg.update(amsgrad=False, decoupled_weight_decay=bool(g["decoupled_weight_decay"]),
                      params=g["params"])
            if "param_names" in g:
                tg["param_names"] = g["param_names"]
            groups.append(tg)
        return {"state": state, "param_groups": groups}

    def to_bitsandbytes_state_dict(self) -> dict:
        """A state_dict that ``bitsandbytes.optim.AdamW8bit`` (``Adam8bit`` for weight_decay=0)
        over the same params and groups loads: per param ``step`` (int), ``state1`` /
        ``state2`` with ``qmap1`` / ``qmap2`` and ``absmax1`` / ``absmax2`` for 8-bit params
        (uint8 codes), fp32 ``state1`` / ``state2`` otherwise; groups with bitsandbytes' keys.
        bitsandbytes' blocks are 256 elements: a group with another block_size is re-quantized
        (nearest codes of the new blocks, not bit-exact). Masters are dropped (bitsandbytes
        has none) and bitsandbytes decides nothing from min_8bit_size once state exists."""
        state, groups, index = {}, [], 0
        for gi, group in enumerate(self.param_groups):
            if any(is_dtensor(p) for p in group["params"]):
                raise NotImplementedError(
                    f"to_bitsandbytes_state_dict: param group {gi} has DTensor params; "
                    "bitsandbytes' optimizers take plain tensors (use state_dict() with DCP)")
            if group["maximize"]:
                raise ValueError(f"to_bitsandbytes_state_dict: param group {gi} has "
                                 "maximize=True, which bitsandbytes does not support")
            if not group["decoupled_weight_decay"] and group["weight_decay"]:
                raise ValueError(
                    f"to_bitsandbytes_state_dict: param group {gi} has weight_decay="
                    f"{group['weight_decay']} with Adam's L2 decay; bitsandbytes' Adam8bit "
                    "decouples weight decay (AdamW), so its steps would differ")
            ids = []
            for p in group["params"]:
                ids.append(index)
                if self.state.get(p):
                    state[index] = self._bnb_entry(group, p, self.state[p])
                index += 1
            lr = group["lr"]
            groups.append({"lr": float(lr.item() if isinstance(lr, torch.Tensor) else lr),
                           "betas": tuple(float(b) for b in group["betas"]),
                           "eps": float(group["eps"]),
                           "weight_decay": float(group["weight_decay"]), "alpha": 0.0,
                           "t_alpha": None, "t_beta3": None, "params": ids})
        return {"state": state, "param_groups": groups}

    def _bnb_entry(self, group, p, st) -> dict:
        """One param's state in bitsandbytes' layout (new tensors: never the live ones)."""
        entry = {"step": int(st["step"].item())}
        if not self._is_8bit_state(st):
            entry.update(state1=st["exp_avg"].detach().float().clone(),
                         state2=st["exp_avg_sq"].detach().float().clone())
            return entry
        dev = st["exp_avg"].device
        # the live layout: it lags a block_size change until the next step converts it
        block = _state_block_size(st, p.numel(), group["block_size"])
        for n, key, qmap in ((1, "exp_avg", signed_map(dev)), (2, "exp_avg_sq", unsigned_map(dev))):
            codes, absmax = st[key], st[key + "_absmax"]
            if block != _BNB_BLOCK:
                codes, absmax = quantize_blockwise(
                    dequantize_blockwise(codes, absmax, qmap, block), qmap, _BNB_BLOCK)
            entry.update({f"state{n}": codes.clone(), f"absmax{n}": absmax.clone(),
                          f"qmap{n}": qmap.clone()})
        return entry

    def from_torch_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim.AdamW``/``Adam`` (or mpfused, or bitsandbytes 8-bit)
        state_dict: the same as ``load_state_dict``, which quantizes fp32 moments as needed."""
        self.load_state_dict(state_dict)
