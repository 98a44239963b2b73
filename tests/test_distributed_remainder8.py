"""master_weights="remainder8" (bf16 params + an int8 correction) under FSDP2 + DCP for AdamW,
AdamW8bit and AdamW4bit (issue 24 item 5), on CPU with gloo and 2 processes (the launch of
tests/distributed_4bit_runs.py, shared with tests/test_adamw4bit_fsdp.py).

tests/distributed_model.py's model, data (with the inf step every rank skips) and GradScaler,
tests/distributed_runs.py's single-process method: without clipping the 2-rank run equals the emulated data-parallel one bit
for bit (params, every state tensor: the int8 corrections, the 8-/4-bit codes and absmax of
fc2.weight, whose shards are whole blocks of 256 / 128). The DCP checkpoint (after CKPT_AT steps)
loads into a fresh model and optimizer bit for bit and the run resumes bit-identically.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed_4bit_runs import results, train_single
from tests.distributed_model import params_of, state_snapshot

NAMES = ["r8_adamw", "r8_adamw8bit", "r8_adamw4bit"]


def _results(name):
    res, _ = results()
    out = [r[name] for r in res]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank}, scenario {name}:\n{r['error']}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_trains_as_one_process(name):
    cs = _results(name)
    model, opt, scaler = train_single(name)
    ref, snap = params_of(model), state_snapshot(model, opt)
    for rank, c in enumerate(cs):
        for k, v in ref.items():
            assert v.dtype == torch.bfloat16
            assert torch.equal(c["final_params"][k], v), f"rank {rank} {k}: not bit-identical"
        assert c["final_scale"] == scaler.get_scale()
        for pname, st in snap.items():
            got = c["final_state"][pname]
            assert got.keys() == st.keys(), (pname, got.keys(), st.keys())
            assert "master_remainder8" in got, pname
            for key, want in st.items():
                have = got[key]
                if c["final_kinds"][pname][key][0] != "DTensor" and key != "step":
                    have = torch.cat([r["final_state"][pname][key] for r in cs])  # per shard
                assert have.dtype == want.dtype and torch.equal(have, want), (rank, pname, key)
    if name != "r8_adamw":  # fc2.weight's moments are codes (the others fp32)
        assert cs[0]["final_kinds"]["fc2.weight"]["exp_avg"][1] == "torch.uint8"


@pytest.mark.parametrize("name", NAMES)
def test_dcp_resume_is_bit_identical(name):
    for rank, c in enumerate(_results(name)):
        for pname, st in c["saved_state"].items():
            assert c["loaded_kinds"][pname] == c["saved_kinds"][pname], pname
            assert c["saved_kinds"][pname]["master_remainder8"][:2] == ("DTensor", "torch.int8")
            for key, v in st.items():
                assert torch.equal(c["loaded_state"][pname][key], v), (rank, pname, key)
        for k, v in c["saved_params"].items():
            assert torch.equal(c["loaded_params"][k], v), k
        for k, v in c["final_params"].items():
            assert torch.equal(c["resumed_params"][k], v), f"rank {rank} {k}: resume diverged"
        assert c["resumed_scale"] == c["final_scale"]
