"""Documents of varying length (one verse per line) for the character GPT, padded or packed.

Each line becomes a document `[BOS, c1, ..., cn, '\\n']`; a sample is x = doc[:-1] and
y = doc[1:], so x starts with BOS. Unpacked, each row of `seq_len` tokens holds one document
and padding after it; packed, documents are placed end to end in rows by best-fit decreasing
bin packing, so that almost no position is padding. Pads are `PAD_INPUT` in x and
`PAD_TARGET` in y: they cost no loss. A model that restarts positions and attention at each BOS
(`TinyGPT(bos_token=...)`) computes the same per-token loss either way.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.data import Dataset

PAD_TARGET = -100  # F.cross_entropy's default ignore_index: a padded position costs no loss
PAD_INPUT = 0  # any token: no real target attends to a pad (pads come after their row's documents)


def documents(lines: list[str], index: dict[str, int], bos: int, seq_len: int) -> list[list[int]]:
    """Each line, with its newline, as `[bos, tokens...]`; a line longer than `seq_len`
    characters is cut into pieces of at most `seq_len`, each piece its own document."""
    docs = []
    for line in lines:
        body = [index[ch] for ch in line + "\n"]
        docs.extend([bos, *body[i : i + seq_len]] for i in range(0, len(body), seq_len))
    return docs


def pack(docs: list[list[int]], seq_len: int, seed: int = 0) -> list[list[list[int]]]:
    """Rows of documents whose inputs (a document's length minus one) fill at most `seq_len`
    tokens each; every document lands in exactly one row. Best-fit decreasing: longest first,
    each into the fullest row that still has room for it, a new row when none has."""
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(len(docs), generator=generator).tolist()
    order = sorted(shuffled, key=lambda i: -len(docs[i]))  # stable: equal lengths keep the draw
    rows: list[list[list[int]]] = []
    by_room: dict[int, list[int]] = defaultdict(list)  # free tokens -> the rows with that many
    for i in order:
        size = len(docs[i]) - 1
        room = next((r for r in range(size, seq_len + 1) if by_room[r]), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, seq_len
        else:
            row = by_room[room].pop()
        rows[row].append(docs[i])
        by_room[room - size].append(row)
    return rows


class DocumentRows(Dataset):
    """Rows of exactly `seq_len` input and target tokens, each holding whole documents end to
    end (x: a document but its last token, y: the next token of each) and padding after them."""

    def __init__(self, rows: list[list[list[int]]], seq_len: int) -> None:
        if any(sum(len(doc) - 1 for doc in row) > seq_len for row in rows):
            raise ValueError(f"a row holds more than seq_len ({seq_len}) tokens")
        self.rows, self.seq_len = rows, seq_len
        self.num_tokens = len(rows) * seq_len  # input positions, padding included
        self.num_real = sum(len(doc) - 1 for row in rows for doc in row)

    @property
    def padding_fraction(self) -> float:
        """Share of all positions that are padding."""
        return 1 - self.num_real / self.num_tokens if self.num_tokens else 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((self.seq_len,), PAD_INPUT, dtype=torch.long)
        y = torch.full((self.seq_len,), PAD_TARGET, dtype=torch.long)
        at = 0
        for doc in self.rows[i]:
            n = len(doc) - 1
            x[at : at + n], y[at : at + n] = torch.tensor(doc[:-1]), torch.tensor(doc[1:])
            at += n
        return x, y

    def document_lengths(self, i: int) -> list[int]:
        """Tokens of each document in row `i` (for the skew report's attention cost)."""
        return [len(doc) - 1 for doc in self.rows[i]]
