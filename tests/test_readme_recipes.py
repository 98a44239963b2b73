"""The README's "Recipes" section runs, on CPU (moved from tests/test_recipes.py)."""
import re

import torch
from torch import nn
from torch.nn import functional as F

import mpfused
from mpfused import amp
from tests.test_recipes import _mlp, _one_thread, _regression  # noqa: F401  (_one_thread: autouse)


# ---- the README "Recipes" section runs -------------------------------------------------------
def _readme_recipes():
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("\n## Recipes")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else None]
    return re.findall(r"```(python|diff)\n(.*?)```", section, flags=re.S)


def _on_cpu(code):
    return code.replace('"cuda"', '"cpu"').replace(".cuda()", "")


def test_readme_recipes_run(capsys):
    blocks = _readme_recipes()
    assert len(blocks) >= 5

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return self.net(x)

    x, y = _regression()

    def run(code):
        loader = list(zip(x.chunk(8), y.chunk(8)))
        torch.manual_seed(0)
        ns = dict(MyModel=MyModel, loader=loader * 20,
                  loss_fn=lambda out, target: F.mse_loss(out.float(), target))
        exec(compile(_on_cpu(code), "README.md", "exec"), ns)
        model = ns["model"]
        with torch.no_grad(), amp.autocast(model):
            final = F.mse_loss(model(x).float(), y).item()
        return ns, final

    torch.manual_seed(0)
    start = F.mse_loss(MyModel()(x), y).item()
    before = None
    for kind, code in blocks:
        if kind == "diff":  # the "after" of the previous block
            for old, new in zip(re.findall(r"^-(.*)$", code, flags=re.M),
                                re.findall(r"^\+(.*)$", code, flags=re.M)):
                assert old in before
                before = before.replace(old, new)
            ns, final = run(before)
            assert isinstance(ns["opt"], mpfused.AdamW) and isinstance(ns["scaler"], mpfused.GradScaler)
        elif code.startswith(">>> "):
            expr, _, expected = code[4:].partition("\n")
            eval(expr, dict(mpfused=mpfused))
            assert capsys.readouterr().out.strip() == expected.strip()
            continue
        else:
            before = code
            ns, final = run(code)
        assert final < 0.97 * start, code  # it trains (README hyperparameters: slow)
