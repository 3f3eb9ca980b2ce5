"""A Hugging Face weights folder as a `ParameterSource`: each rank reads only what it keeps.

The folder is what `save_pretrained` writes: `model.safetensors`, or shards
`model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json`. A safetensors file
is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and the
raw data. We read the header (every field validated) and then exactly the bytes asked for, with
positioned reads: a ZeRO-3 rank reads its flat slice of a unit, a tensor-parallel rank its rows
or columns, a pipeline stage its own layers. Nothing is memory-mapped: through `safe_open`'s
map, every page a read touches stays resident in the process while the file is open, beside the
copy the rank keeps.

Names are the model's `state_dict` names. A checkpoint may name them without the base model's
prefix (`h.0.attn...` for `transformer.h.0.attn...`, a base model's own checkpoint) or with it
where the model is the base model; both are found, as `from_pretrained` finds them. A tied
weight is stored once, under its first name (the one `named_parameters` gives).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # bytes; safetensors' own limit
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of its first element in the file


class HFWeights:
    """The tensors of a local Hugging Face checkpoint folder, read lazily (see module doc).

    base_prefix: the model's `base_model_prefix` (e.g. "transformer", "model"), to find names
    saved without it, or with it by a model that is the base model itself.
    """

    def __init__(self, folder: Path | str, base_prefix: str = "") -> None:
        self.folder = Path(folder)
        self.base_prefix = base_prefix
        self.file_of = _weight_map(self.folder)
        self._entries: dict[str, dict[str, Entry]] = {}  # file -> its header, once read

    # ---- names
    def key(self, name: str) -> str | None:
        """The checkpoint's key for the model's tensor `name` (None: it has none)."""
        candidates = [name]
        if p := self.base_prefix:
            dropped = name.removeprefix(f"{p}.")
            candidates.append(dropped if dropped != name else f"{p}.{name}")
        return next((c for c in candidates if c in self.file_of), None)

    def __contains__(self, name: str) -> bool:
        return self.key(name) is not None

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def entry(self, name: str) -> Entry:
        key = self.key(name)
        if key is None:
            raise ValueError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        file = self.file_of[key]
        if file not in self._entries:
            self._entries[file] = read_header(self.folder / file)
        entries = self._entries[file]
        if key not in entries:
            raise ValueError(f"{self.folder / file}: has no tensor {key!r} (its index says so)")
        return entries[key]

    # ---- values
    def read(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.read_flat(name, 0, math.prod(shape)).reshape(shape)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements start..stop of the flattened (row-major) tensor: one positioned read."""
        e = self.entry(name)
        if not 0 <= start <= stop <= math.prod(e.shape):
            raise ValueError(f"elements {start}..{stop} of {name!r} {e.shape}: out of range")
        return _read(e, [(start, stop - start)])

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices start..stop of dimension `dim` (a tensor-parallel block): one read per
        index of the dimensions before `dim`."""
        e = self.entry(name)
        if not (0 <= dim < len(e.shape) and 0 <= start <= stop <= e.shape[dim]):
            raise ValueError(f"{start}..{stop} of dimension {dim} of {name!r} {e.shape}")
        inner = math.prod(e.shape[dim + 1 :])
        outer = math.prod(e.shape[:dim])
        block = e.shape[dim] * inner
        runs = [(o * block + start * inner, (stop - start) * inner) for o in range(outer)]
        shape = (*e.shape[:dim], stop - start, *e.shape[dim + 1 :])
        return _read(e, runs).reshape(shape)


def read_header(path: Path) -> dict[str, Entry]:
    """Every tensor's entry in a safetensors file, each field checked against the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its header")
            (length,) = struct.unpack("<Q", head)
            if not 0 < length <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit the file ({size} bytes)")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {_line(e)}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file: its header is not an object")
    entries, data = {}, 8 + length
    for key, field in header.items():
        if key == "__metadata__":
            continue
        entries[key] = _entry(path, key, field, data, size)
    return entries


def _entry(path: Path, key: str, field, data: int, size: int) -> Entry:
    bad = f"{path}: tensor {key!r}:"
    if not isinstance(field, dict) or field.get("dtype") not in DTYPES:
        raise ValueError(f"{bad} no known dtype")
    shape, offsets = field.get("shape"), field.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"{bad} shape {shape!r} is not a list of sizes")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise ValueError(f"{bad} data_offsets {offsets!r} are not [begin, end]")
    dtype = DTYPES[field["dtype"]]
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not (0 <= begin <= end and end - begin == nbytes and data + end <= size):
        raise ValueError(
            f"{bad} bytes {begin}..{end} do not hold {tuple(shape)} or lie past the end"
        )
    return Entry(path, dtype, tuple(shape), data + begin)


def _read(e: Entry, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The elements of each (first element, count) run, end to end, read from the file."""
    item = e.dtype.itemsize
    out = bytearray(sum(n for _, n in runs) * item)
    view, at = memoryview(out), 0
    fd = os.open(e.path, os.O_RDONLY)
    try:
        for first, n in runs:
            want = n * item
            got = os.preadv(fd, [view[at : at + want]], e.begin + first * item)
            if got != want:
                raise ValueError(f"{e.path}: truncated (read {got} of {want} bytes)")
            at += want
    finally:
        os.close(fd)
    if not out:
        return torch.empty(0, dtype=e.dtype)
    return torch.frombuffer(out, dtype=e.dtype)


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file's own header (validated)."""
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder / INDEX}: not JSON: {_line(e)}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{folder / INDEX}: no weight_map of tensor names to files")
        for file in set(weight_map.values()):
            if Path(file).name != file or not (folder / file).is_file():
                raise ValueError(
                    f"{folder / INDEX}: names a file that is not in the folder: {file}"
                )
        return weight_map
    if (folder / SINGLE).is_file():
        return dict.fromkeys(read_header(folder / SINGLE), SINGLE)
    raise ValueError(f"{folder}: no {SINGLE} or {INDEX} (a Hugging Face weights folder)")


def _line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]
