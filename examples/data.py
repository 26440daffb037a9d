"""Training data: real text with no download, and the synthetic permutation task.

**The standard-library corpus.**  Every CPython installation ships its standard
library as source, so real text is on every machine that can run this project.
:func:`load_stdlib_corpus` reads

- every top-level module ``<stdlib>/*.py`` (``sysconfig.get_paths()["stdlib"]``,
  e.g. ``/usr/lib/python3.11``), except the machine-generated
  ``_sysconfigdata_*.py``, and
- ``<stdlib>/pydoc_data/topics.py``: the Python language reference's prose as
  shown by ``help()`` (about 750 kB of English documentation),

in sorted order, as raw bytes (byte-level tokens, vocabulary 256).  A file goes to
the validation split when the first byte of ``sha256(relative path)`` is ``0 mod
10`` (about 10% of the files; on 3.11, 23 files and 0.5 MB), so a file lands on the
same side on every Python version that has it; the rest is the training split.
The text is under the Python Software Foundation License (``<stdlib>/LICENSE.txt``).

The corpus differs a little between Python minor versions (modules are added and
removed); :attr:`TextCorpus.fingerprint` (Python version, file and byte counts,
sha256 of both splits) identifies exactly what a run trained on.

**Batches** are deterministic functions of ``(seed, step)``, the same on every rank
and for every optimizer: training windows start at seeded random offsets into the
training bytes; validation windows are fixed and evenly spaced over the
validation bytes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

BYTE_VOCAB = 256
DOCS_FILE = os.path.join("pydoc_data", "topics.py")
VALIDATION_MODULUS = 10
# Files are joined with a blank line so that a window spanning two files still
# reads like source text.
FILE_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class TextCorpus:
    """Byte tokens of the training and validation splits (uint8 tensors)."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    root: str

    @property
    def fingerprint(self) -> dict:
        return {
            "source": "CPython standard library (*.py top-level modules + pydoc_data/topics.py)",
            "license": "Python Software Foundation License",
            "root": self.root,
            "python": sys.version.split()[0],
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "train_sha256": hashlib.sha256(self.train.numpy().tobytes()).hexdigest(),
            "val_sha256": hashlib.sha256(self.val.numpy().tobytes()).hexdigest(),
        }


def stdlib_dir() -> str:
    """The directory that holds this interpreter's pure-Python standard library."""
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str) -> list[str]:
    """Relative paths of the corpus files under ``root``, sorted."""
    names = [
        f for f in os.listdir(root)
        if f.endswith(".py") and not f.startswith("_sysconfigdata") and os.path.isfile(os.path.join(root, f))
    ]
    if os.path.isfile(os.path.join(root, DOCS_FILE)):
        names.append(DOCS_FILE)
    return sorted(names)


def is_validation_file(relative_path: str) -> bool:
    """The fixed split rule: by a hash of the path, not its position, so that a
    module added or removed in another Python version moves no other file."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).digest()
    return digest[0] % VALIDATION_MODULUS == 0


@functools.lru_cache(maxsize=4)
def load_stdlib_corpus(root: str | None = None) -> TextCorpus:
    """Read the corpus (see the module docstring); ``root`` defaults to :func:`stdlib_dir`."""
    root = root or stdlib_dir()
    files = corpus_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files in {root!r}; is this a CPython standard library directory?")
    train_files = tuple(f for f in files if not is_validation_file(f))
    val_files = tuple(f for f in files if is_validation_file(f))
    if not train_files or not val_files:
        raise FileNotFoundError(f"{root!r} has too few files for a train/validation split ({len(files)} files)")

    def read(names):
        parts = []
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                parts.append(f.read())
        joined = bytearray(FILE_SEPARATOR.join(parts))
        # frombuffer shares the bytearray's memory; the clone owns its own.
        if not joined:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(joined, dtype=torch.uint8).clone()

    return TextCorpus(train=read(train_files), val=read(val_files), train_files=train_files,
                      val_files=val_files, root=root)


def train_batch(corpus: TextCorpus, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """The global training batch of ``step``: ``[batch_size, seq_len + 1]`` token ids.

    Windows start at random offsets drawn from a generator seeded by ``(seed,
    step)`` alone, so every rank, every optimizer and every rerun sees the same
    sequence of batches.
    """
    span = seq_len + 1
    if corpus.train.numel() < span:
        raise ValueError(f"training split has {corpus.train.numel()} bytes, fewer than seq_len + 1 = {span}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    starts = torch.randint(corpus.train.numel() - span + 1, (batch_size,), generator=gen)
    return _windows(corpus.train, starts, span)


def val_batch(corpus: TextCorpus, n_sequences: int, seq_len: int) -> torch.Tensor:
    """The fixed validation set: ``n_sequences`` windows evenly spaced over the split."""
    span = seq_len + 1
    if corpus.val.numel() < span * n_sequences:
        raise ValueError(f"validation split has {corpus.val.numel()} bytes, fewer than "
                         f"{n_sequences} windows of {span}; lower the count or seq_len")
    starts = torch.linspace(0, corpus.val.numel() - span, n_sequences).long()
    return _windows(corpus.val, starts, span)


def _windows(data: torch.Tensor, starts: torch.Tensor, span: int) -> torch.Tensor:
    index = starts[:, None] + torch.arange(span)
    return data[index].long()


def synthetic_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` tokens that follow a fixed random permutation.

    Each sequence starts at a random token, then the next token is always
    ``perm[current]`` (the permutation is seeded by ``seed``): a task with a known
    answer for checking that a run learns at all, not for judging optimisers.
    """
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tok = torch.randint(vocab_size, (batch_size,), generator=gen)
    seq = [tok]
    for _ in range(seq_len):
        tok = perm[tok]
        seq.append(tok)
    return torch.stack(seq, dim=1)
