"""sgd8bit_step_ / lion8bit_step_ step for step against bitsandbytes' SGD8bit (momentum,
dampening 0: bitsandbytes ignores dampening and nesterov) and Lion8bit on CPU, from bitsandbytes'
own state (its zero-initialised codes and absmax, its step counting) over STEPS steps.

Each step starts both sides from the same param and state: after a step is compared, mpfused takes
bitsandbytes' param, codes and absmax (so a one-code difference never compounds; without it the
two walk apart by whole quantization steps, as two 8-bit runs with different roundings do).
bitsandbytes' CPU path updates with torch ops (add_ with alpha may fuse a multiply-add) and
quantizes with its own table-driven encoder, which is not always the nearest code, and no sign
rule. Per step, asserted (measured over 12 steps x 155,100 elements, fp32):
* params within rtol 1e-6, atol 1e-9 (measured: Lion equal, SGD <= 3.0e-8 = 1 ulp);
* absmax within 1e-6 relative (measured: <= 1.2e-7);
* codes equal for >= 99.5% of elements (measured: 99.82-99.84%; bitsandbytes' encoder alone
  differs from the nearest code on 0.15% of random normal values, always further from the value),
  and decoded, every difference at most the map's widest spacing times the absmax (measured:
  0.0140626 vs 0.0140625: one code apart; the sign rule did not fire on these states)."""
import pytest
import torch

from mpfused import quant_maps as qm
from mpfused.ops import OPS
from tests.tolerances import DECODED_GAP_ROUNDING

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(not OPS["sgd8bit_step_"].native_available("cpu"),
                                reason="native extension not built")

STEPS = 12
MAX_GAP = (qm.signed_map()[1:] - qm.signed_map()[:-1]).max().item()  # 0.0140625, next to -1


def _optimizers(kind, p0, wd):
    pb = torch.nn.Parameter(p0.clone())
    if kind == "sgd":
        ob = bnb.optim.SGD8bit([pb], lr=0.05, momentum=0.9, weight_decay=wd, min_8bit_size=1)
    else:
        ob = bnb.optim.Lion8bit([pb], lr=1e-3, betas=(0.9, 0.99), weight_decay=wd,
                                min_8bit_size=1)
    ob.init_state(ob.param_groups[0], pb, 0, 0)
    return pb, ob


def _ours(kind, p, g, codes, absmax, step, wd):
    if kind == "sgd":
        OPS["sgd8bit_step_"]([p], [g], [codes], [absmax], [], [step], qm.signed_map(),
                             block_size=256, lr=0.05,
                             lr_tensor=None, momentum=0.9, dampening=0.0, weight_decay=wd,
                             nesterov=False, maximize=False, master_mode=0, backend="native")
    else:
        OPS["lion8bit_step_"]([p], [g], [codes], [absmax], [], [step], qm.signed_map(),
                              block_size=256, lr=1e-3,
                              lr_tensor=None, beta1=0.9, beta2=0.99, weight_decay=wd,
                              maximize=False, master_mode=0, backend="native")


@pytest.mark.parametrize("wd", [0.0, 1e-2])
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_step_for_step_against_bitsandbytes(kind, wd):
    shape = (300, 517)  # a partial last block
    p0 = torch.randn(shape) * 0.1
    pb, ob = _optimizers(kind, p0, wd)
    sb = ob.state[pb]
    assert sb["qmap1"].numpy().tobytes() == qm.signed_map().numpy().tobytes()
    p, step = p0.clone(), torch.zeros(())
    codes, absmax = sb["state1"].clone(), sb["absmax1"].clone()
    for t in range(STEPS):
        g = torch.randn(shape) * 1e-2
        pb.grad = g.clone()
        ob.step()
        _ours(kind, p, g, codes, absmax, step, wd)
        assert step.item() == sb["step"] == t + 1
        torch.testing.assert_close(p, pb.detach(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(absmax, sb["absmax1"], rtol=1e-6, atol=0)
        diff = codes != sb["state1"]
        assert diff.float().mean().item() <= 5e-3, t
        # decoded, relative to the block's absmax: at most the map's widest spacing apart
        da = qm.dequantize_blockwise(codes, absmax, qm.signed_map(), 256)
        db = qm.dequantize_blockwise(sb["state1"], sb["absmax1"], qm.signed_map(), 256)
        scale = absmax.repeat_interleave(256)[: p.numel()].view(shape)
        assert ((da - db).abs() / scale).max().item() <= MAX_GAP + DECODED_GAP_ROUNDING, t
        with torch.no_grad():  # the next step starts from bitsandbytes' values
            p.copy_(pb)
            codes.copy_(sb["state1"])
            absmax.copy_(sb["absmax1"])
