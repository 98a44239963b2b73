"""bitsandbytes' 32-bit Adam/AdamW, SGD and Lion checkpoints load into mpfused.AdamW, SGD and Lion
(state1/state2, nested under ``__bnb_optimizer_quant_state__`` since bitsandbytes 0.49.2, become
the optimizer's own keys) and the run continues as bitsandbytes' would; 8-bit ones stay refused
with the message that names the 8-bit optimizer to load them into."""
import pytest
import torch

import mpfused

bnb = pytest.importorskip("bitsandbytes")

CASES = [  # (bitsandbytes class, mpfused class, keywords both take)
    ("Adam", mpfused.Adam, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)),
    ("AdamW", mpfused.AdamW, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
    ("SGD", mpfused.SGD, dict(lr=1e-2, momentum=0.9)),
    ("Lion", mpfused.Lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
]


def _run(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


@pytest.mark.parametrize("bnb_name,cls,kw", CASES, ids=[c[0] for c in CASES])
def test_bitsandbytes_32bit_state_loads_and_continues(bnb_name, cls, kw):
    gen = torch.Generator().manual_seed(0)
    shapes = [(33, 7), (300,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = getattr(bnb.optim, bnb_name)(ref, **kw)
    _run(ref_opt, ref, grads[:3])
    sd = ref_opt.state_dict()

    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = cls(ours, **kw)
    opt.load_state_dict(sd)
    keys = cls._BNB_STATE_KEYS
    for i, p in enumerate(ours):
        inner = sd["state"][i].get("__bnb_optimizer_quant_state__", sd["state"][i])
        for key, name in zip(keys, ("state1", "state2")):
            assert opt.state[p][key].dtype == torch.float32
            torch.testing.assert_close(opt.state[p][key], inner[name], rtol=0, atol=0)
    _run(ref_opt, ref, grads[3:])
    _run(opt, ours, grads[3:])
    for a, b in zip(ours, ref):
        # bitsandbytes' CPU kernels and ours round the same update differently: fp32 noise over
        # three steps (Lion: a sign flip moves an element by 2 lr, none happen on these grads)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bitsandbytes_8bit_state_is_still_refused_by_the_fp32_optimizer():
    p = torch.nn.Parameter(torch.randn(4096))
    ref_opt = bnb.optim.Lion8bit([p], lr=1e-3)
    p.grad = torch.randn(4096)
    ref_opt.step()
    opt = mpfused.Lion([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    with pytest.raises(ValueError, match="8-bit optimizer state"):
        opt.load_state_dict(ref_opt.state_dict())
