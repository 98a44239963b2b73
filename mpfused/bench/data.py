"""Training text: the Python standard library's own source code, read from disk (no download).

Characters are ASCII codes (vocabulary of 128; the few non-ASCII characters become '?'), so the
vocabulary does not depend on which files or Python version are present. Batches are drawn from a
pre-generated table of offsets, so every recipe sees exactly the same sequence of batches."""
import os
import sysconfig
from dataclasses import dataclass

import torch

VOCAB_SIZE = 128

# A fixed, sorted list of stdlib modules that exist in every supported Python (3.9+). A module
# is read from `<name>.py` or, when it became a package, from `<name>/__init__.py`.
STDLIB_MODULES = sorted([
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "doctest", "email/message", "enum", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "imaplib",
    "inspect", "ipaddress", "json/decoder", "json/encoder", "locale", "logging", "mailbox",
    "numbers", "operator", "optparse", "pathlib", "pickle", "pprint", "queue", "random", "selectors",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing",
    "unittest/case", "uuid", "warnings", "weakref", "zipfile",
])


@dataclass
class Corpus:
    train: torch.Tensor       # int64 token ids
    validation: torch.Tensor  # held-out tail of the text
    files: list
    n_chars: int


def _module_path(stdlib_dir, name):
    for candidate in (f"{name}.py", os.path.join(name, "__init__.py")):
        path = os.path.join(stdlib_dir, candidate)
        if os.path.isfile(path):
            return path
    return None


def load_stdlib_corpus(validation_fraction=0.05):
    """Concatenate the listed stdlib sources; the last `validation_fraction` is held out."""
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    files, chunks = [], []
    for name in STDLIB_MODULES:
        path = _module_path(stdlib_dir, name)
        if path is None:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            chunks.append(f.read())
        files.append(os.path.relpath(path, stdlib_dir))
    text = "\n\n".join(chunks)
    if len(text) < 100_000:
        raise RuntimeError(f"too little stdlib source found under {stdlib_dir} ({len(text)} chars)")
    codes = torch.frombuffer(bytearray(text.encode("ascii", errors="replace")), dtype=torch.uint8)
    tokens = codes.long()
    split = int(len(tokens) * (1 - validation_fraction))
    return Corpus(train=tokens[:split], validation=tokens[split:], files=files, n_chars=len(text))


def batch_offsets(n_tokens, context_length, batch_size, n_batches, seed):
    """(n_batches, batch_size) random start offsets: the whole run's batches, fixed up front."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - context_length - 1, (n_batches, batch_size),
                         generator=generator)


def make_batch(tokens, offsets, context_length):
    """Inputs and next-character targets, both (batch, context_length), on tokens' device."""
    index = offsets.to(tokens.device)[:, None] + torch.arange(context_length + 1,
                                                              device=tokens.device)
    window = tokens[index]
    return window[:, :-1], window[:, 1:]
