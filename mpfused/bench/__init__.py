"""mpfused.bench: end-to-end comparison of mixed-precision training recipes.

`python -m mpfused.bench --help` trains a small character-level GPT on the Python standard
library's own source code once per recipe (torch native AMP, mpfused, mpfused 8-bit, and the
bitsandbytes / torchao 8-bit peers where installed), from the same initial weights on the same
batches, and reports step time, optimizer+scaler time, memory, bytes per parameter and loss.

Layout: model.py (the GPT), data.py (stdlib corpus and batches), presets.py (sizes),
recipes.py (what each recipe builds), memory.py (byte accounting), train.py (timed loop),
runner.py (all recipes), report.py (table, JSON), plot.py (PNG), cli.py (arguments)."""


def main(argv=None):
    from mpfused.bench.cli import main as cli_main
    return cli_main(argv)
