"""A token corpus larger than memory: nanoGPT's `train.bin` layout, a flat binary array of token
ids (uint16 for GPT-2's vocabulary), read through `numpy.memmap` and never loaded whole.

    splits = token_splits("train.bin", "uint16", seq_len=1024, test_fraction=0.1)
    x, y = splits.train[i]     # tokens[s : s+1024] and tokens[s+1 : s+1025], s = i * 1024

Sample i is the i-th window of `seq_len` tokens and its target the same window one token later:
windows do not overlap, so an epoch trains on every token once, and a sample is a number like
any dataset's (the sharded loader's position, the sample ledger and an exact resume hold as
they do for the built-in datasets). Only the windows a batch asks for are read (the operating
system pages them in); with `as_dicts`, a sample is {"input_ids", "labels"} with labels equal to
input_ids, as Hugging Face causal language models take them (they shift the labels themselves).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.data.datasets import Splits

DTYPES = ("uint16", "uint32", "int32", "int64")


def open_tokens(path: Path | str, dtype: str) -> np.memmap:
    """The file's tokens, mapped read-only (a one-line error for a file that is not whole)."""
    if dtype not in DTYPES:
        raise ValueError(f"token dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    size, item = Path(path).stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"{path}: the token file is empty")
    if size % item:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return np.memmap(path, dtype=dtype, mode="r")


class TokenWindows(Dataset):
    """Windows of `seq_len` tokens of `tokens[start:stop]` (a memmap: nothing is copied but
    the windows read), each with its next-token targets. `vocab_size` (0: unknown): each
    window's ids are checked to lie below it as it is read (a file of another tokenizer's ids
    would index past the model's embedding)."""

    def __init__(
        self,
        tokens: np.memmap,
        seq_len: int,
        start: int = 0,
        stop: int | None = None,
        as_dicts: bool = False,
        vocab_size: int = 0,
    ) -> None:
        stop = len(tokens) if stop is None else stop
        if stop - start < seq_len + 1:
            raise ValueError(
                f"{stop - start} tokens hold no window of seq_len {seq_len} (and its target)"
            )
        self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop
        self.as_dicts, self.vocab_size = as_dicts, vocab_size
        self.vocab_named = "data.vocab_size"  # (where the bound comes from, for its error)

    def __len__(self) -> int:
        # Each window needs one token past its end (the last target).
        return (self.stop - self.start - 1) // self.seq_len

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        begin = self.start + i * self.seq_len
        window = torch.from_numpy(self.tokens[begin : begin + self.seq_len + 1].astype(np.int64))
        if self.vocab_size and not 0 <= int(window.min()) <= int(window.max()) < self.vocab_size:
            bad = window[(window < 0) | (window >= self.vocab_size)][0]
            raise ValueError(
                f"{getattr(self.tokens, 'filename', 'the token file')}: token id {int(bad)} "
                f"(window {i}) is not within {self.vocab_named} {self.vocab_size}"
            )
        x, y = window[:-1], window[1:]
        if self.as_dicts:
            return {"input_ids": x, "labels": x.clone()}
        return x, y


def token_splits(
    path: Path | str,
    dtype: str,
    seq_len: int,
    test_fraction: float,
    eval_path: Path | str | None = None,
    as_dicts: bool = False,
    vocab_size: int = 0,
) -> Splits:
    """Training windows of `path`, and evaluation windows of `eval_path` or else of the last
    `test_fraction` of `path`. `vocab_size` is what the model is told (0: unknown)."""
    tokens = open_tokens(path, dtype)
    if eval_path is not None:
        train = TokenWindows(tokens, seq_len, as_dicts=as_dicts, vocab_size=vocab_size)
        test = TokenWindows(
            open_tokens(eval_path, dtype), seq_len, as_dicts=as_dicts, vocab_size=vocab_size
        )
    else:
        split = int(len(tokens) * (1 - test_fraction))
        train = TokenWindows(tokens, seq_len, 0, split, as_dicts, vocab_size)
        test = TokenWindows(tokens, seq_len, split, len(tokens), as_dicts, vocab_size)
    return Splits(train, test, vocab_size, seq_len)
