"""Real datasets that need no download: scikit-learn's digits and a committed public-domain text.

`genesis_kjv.txt` is the Book of Genesis, King James Version (public domain), taken from
Debian's bible-kjv-text package with the verse references removed: one verse per line.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from shardwise.data.datasets.packing import PAD_TARGET, DocumentRows, documents, pack

__all__ = ["PAD_TARGET", "CharSequences", "DocumentRows", "Splits", "digits", "text", "verses"]


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    num_classes: int  # classes, or vocabulary size for text
    input_dim: int  # features per sample, or sequence length for text
    bos_token: int | None = None  # text cut into documents: the token that starts each


def digits(test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """1,797 8x8 handwritten digits (UCI, shipped with scikit-learn), scaled to [0, 1]."""
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    num_test = int(len(x) * test_fraction)
    test, train = order[:num_test], order[num_test:]
    return Splits(TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), 10, 64)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (1797 x 64) and labels: read from the file scikit-learn ships them in
    (what `load_digits` reads) without importing scikit-learn, which costs each rank of every
    job half a second; through `load_digits` where that file is not found."""
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        if table.shape == (1797, 65):
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


class CharSequences(Dataset):
    """Windows of `seq_len` characters and the same window shifted by one (next-char targets)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        if len(tokens) <= seq_len:
            raise ValueError(f"text of {len(tokens)} characters is too short for seq_len {seq_len}")
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def _characters(path: Path, content: str, run_text: str | None) -> list[str]:
    """The vocabulary of a character model: `content`'s characters, or where the run's model
    was made for another text (`run_text`: a later stage's file), that one's, which must hold
    every character of `content` (ids are places in the vocabulary: another file's would
    mean other characters to the same model)."""
    vocab = sorted(set(content if run_text is None else run_text))
    if run_text is not None and (new := set(content) - set(vocab)):
        raise ValueError(
            f"{path}: {len(new)} character(s) ({''.join(sorted(new))[:20]!r}) are not in the "
            "vocabulary of the run's data.path, which its model was made for"
        )
    return vocab


def read_text_file(path: Path) -> str:
    """A text dataset's content: UTF-8 and not empty, else a one-line `ValueError` naming it."""
    try:
        content = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not content.strip():
        raise ValueError(f"{path}: no text in it")
    return content


def text(
    path: Path, seq_len: int = 128, test_fraction: float = 0.1, run_text: str | None = None
) -> Splits:
    """A character-level language-modelling dataset: the last `test_fraction` is held out.
    `run_text`: the text whose characters are the vocabulary (a stage's, the run's own)."""
    content = read_text_file(path)
    vocab = _characters(path, content, run_text)
    index = {ch: i for i, ch in enumerate(vocab)}
    tokens = torch.tensor([index[ch] for ch in content], dtype=torch.long)
    split = int(len(tokens) * (1 - test_fraction))
    stride = max(1, seq_len // 2)
    train = CharSequences(tokens[:split], seq_len, stride)
    test = CharSequences(tokens[split:], seq_len, seq_len)
    return Splits(train, test, len(vocab), seq_len)


def verses(
    path: Path,
    seq_len: int = 256,
    test_fraction: float = 0.1,
    packing: str = "none",
    seed: int = 0,
    run_text: str | None = None,
) -> Splits:
    """The text's lines as documents of varying length (`datasets.packing`): the vocabulary is
    its characters plus a start-of-document token. The last `test_fraction` of the lines is held
    out, one document per row; with `packing` 'pack' the training rows are packed. `run_text`:
    as `text`'s."""
    if packing not in ("none", "pack"):
        raise ValueError(f"packing must be 'none' or 'pack', got {packing!r}")
    content = read_text_file(path)
    vocab = _characters(path, content, run_text)
    index = {ch: i for i, ch in enumerate(vocab)}
    bos = len(vocab)
    lines = content.splitlines()
    split = int(len(lines) * (1 - test_fraction))
    train, test = (documents(part, index, bos, seq_len) for part in (lines[:split], lines[split:]))
    rows = pack(train, seq_len, seed) if packing == "pack" else [[doc] for doc in train]
    test_rows = DocumentRows([[doc] for doc in test], seq_len)
    return Splits(DocumentRows(rows, seq_len), test_rows, len(vocab) + 1, seq_len, bos)
