"""Checkpoints: the final model as one safetensors file, and sharded, reshardable training state.

Sharded checkpoints (`save_checkpoint` / `load_checkpoint`): each rank writes only what it holds
(`rank{r}.safetensors`: its slice of every flat unit of parameters and optimizer state), then
rank 0 writes `manifest.json` (layout: which parameters each unit holds, their shapes, shard
sizes; world size; SHA-256 of every file). A save writes everything into a hidden sibling
directory (`.NAME.tmp`), fsyncs it, the manifest last, and only then renames it into place (an
existing checkpoint is first moved aside to `.NAME.old`, removed once the new one is in place):
at every moment a complete checkpoint exists, and a kill during a re-save leaves the previous
one loadable. Reading trusts nothing in the manifest: its fields are type-checked, its file
names must be exactly `rank{r}.safetensors` / `extra{r}.safetensors` of this directory, and
every problem is one `CheckpointError` line. Loading rebuilds each parameter's full tensor (and
each optimizer-state tensor) from the shards, then the loading strategy takes its own slices:
the world size and even the strategy may differ (4 -> 2, ZeRO-3 -> DDP). `export_checkpoint`
turns a sharded checkpoint into plain fp32 weights, no process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shardwise import comm
from shardwise.distributed.same_everywhere import check_same_everywhere
from shardwise.observe.run_output import check_writable_file, os_reason
from shardwise.strategies.base import DistributedModel, DistributedOptimizer

FORMAT = "shardwise-sharded-v1"


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint; the message says which file."""


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temporary sibling, fsync, then rename: a reader never sees a partial file,
    and a write that fails leaves no temporary behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries (what renames and new files changed), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WEIGHTS = "model.safetensors"  # a final checkpoint's weights, beside its meta.json


def save_model(directory: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Save `state` (a full state dict) and `meta` under `directory`, the weights' SHA-256 in
    the meta (`load_model` checks it); returns the weights path."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    weights = directory / WEIGHTS
    digests = {}

    def write(path: Path) -> None:
        save_file(tensors, str(path), metadata={"format": "pt"})
        digests[WEIGHTS] = sha256_file(path)

    # (weights, then their checksum: a kill between the two renames, where a resumed run
    # saves its final weights again, leaves new weights beside the old checksum, refused)
    _atomic(weights, write)
    meta = {**meta, "sha256": digests}
    _atomic(directory / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2)))
    return weights


def load_model(directory: Path) -> dict[str, torch.Tensor]:
    """A final checkpoint's weights (`save_model`), checked against the SHA-256 its meta.json
    records (where it records one: an older shardwise's does not); a file that is not one is
    a `CheckpointError` naming it."""
    directory = Path(directory)
    path = directory / WEIGHTS
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):  # (none, or unreadable: the file's own header is the check)
        meta = None
    digests = meta.get("sha256") if isinstance(meta, dict) else None
    expected = digests.get(WEIGHTS) if isinstance(digests, dict) else None
    return _read(path) if expected is None else _verified(path, expected)


def check_paired(model: DistributedModel, optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` is the one `sw.prepare` returned with `model`: another's state was saved, or
    loaded, as this model's (and lost: a checkpoint with no moments, an AdamW's loaded into an
    SGD), without a word."""
    check_prepared(model)
    if not _paired(model, optimizer):
        raise ValueError(
            "the optimizer is not this model's: pass the one sw.prepare returned with it"
        )


def check_prepared(model) -> None:
    """A plain module has no ranks, shards or runtime to save or load them by."""
    if not isinstance(model, DistributedModel):
        raise TypeError(
            f"the model must be the one sw.prepare returned, got a plain {type(model).__name__}"
        )


def _paired(model: DistributedModel, optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, DistributedOptimizer) and model.is_stepped_by(optimizer)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The class of the torch optimizer that steps (a `DistributedOptimizer`'s inner one)."""
    return type(getattr(optimizer, "inner", None) or optimizer).__name__


def check_step(step: Any) -> None:
    """A checkpoint's step is a whole number >= 0 (saved, any other makes a checkpoint that no
    load accepts, in place of the one it replaced); else a one-line `CheckpointError`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"a checkpoint's step must be a whole number >= 0, got {step!r}")


def make_manifest(
    step: int,
    world_size: int,
    layout: dict[str, Any],
    shards: dict[str, str],
    strategy_state: dict[str, str] | None,
    optimizer: str,
) -> dict[str, Any]:
    """A sharded checkpoint's manifest: its layout, the optimizer class whose state it holds
    (`optimizer_name`), and every file's SHA-256."""
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        **layout,
        "optimizer": optimizer,
        "sha256": shards,
        "strategy_state_sha256": strategy_state or {},
    }


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _siblings(directory: Path) -> tuple[Path, Path]:
    """Where a save writes (`.NAME.tmp`) and where it moves the checkpoint it replaces
    (`.NAME.old`). Derived from the name alone, so every rank agrees without a message."""
    return (
        directory.with_name(f".{directory.name}.tmp"),
        directory.with_name(f".{directory.name}.old"),
    )


def save_checkpoint(
    model: DistributedModel, optimizer: torch.optim.Optimizer, directory: str | Path, step: int = 0
) -> None:
    """Collective: every rank writes its shard; rank 0 then writes the manifest and moves the
    finished checkpoint into place (replacing `directory` if it exists).

    Beside the reshardable per-parameter state, each rank writes its strategy state (the
    model's `extra_state()`: codec residuals, counters, loss scale), restored when the
    checkpoint is loaded by the same strategy on as many ranks."""
    check_prepared(model)  # (alone on its rank: a plain module takes part in no collective)
    directory = Path(os.path.abspath(directory))  # "ckpt/.." has no name to make siblings of
    rt = model.runtime
    # What every rank must give alike, compared before any rank may refuse alone (leaving the
    # others in a collective): one checkpoint, every rank's shard in it (a directory per rank
    # was half-written each), of one step, saved with the model's own optimizer.
    alike = [
        f"directory {directory}",
        f"step {step!r}",
        f"its model's optimizer {_paired(model, optimizer)}",
    ]
    check_same_everywhere(alike, "save_checkpoint: what was given", rt.group, rt.device)
    check_step(step)
    check_paired(model, optimizer)
    tmp, _ = _siblings(directory)
    _check_replaceable(directory)  # on every rank, before anyone waits for anyone
    layout, tensors = model.checkpoint_shard(optimizer)
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    comm.barrier(rt.group)  # the others write only into the fresh directory
    if tensors is not None:  # strategies with replicated state write from rank 0 only
        _write_tensors(tmp / f"rank{rt.rank}.safetensors", tensors)
    extra = model.extra_state()  # the same keys on every rank
    if extra:
        _write_tensors(tmp / f"extra{rt.rank}.safetensors", extra)
    comm.barrier(rt.group)
    if rt.is_main:
        files = [f"rank{r}.safetensors" for r in range(layout["num_shards"])]
        extra_files = [f"extra{r}.safetensors" for r in range(rt.world_size)] if extra else []
        manifest = make_manifest(
            step,
            rt.world_size,
            layout,
            {name: sha256_file(tmp / name) for name in files},
            {name: sha256_file(tmp / name) for name in extra_files},
            optimizer_name(optimizer),
        )
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        fsync_path(tmp / "manifest.json")
        fsync_path(tmp)
        _move_into_place(tmp, directory)
    comm.barrier(rt.group)


# What a checkpoint directory may hold (older versions' per-file temporaries included).
_OURS = re.compile(r"\.?(manifest\.json|(rank|extra)[0-9]+\.safetensors)(\.tmp)?")


def _check_replaceable(directory: Path) -> None:
    """A re-save replaces the whole directory, so it must hold nothing but a checkpoint."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {directory}: not a directory")
    others = sorted(p.name for p in directory.iterdir() if not _OURS.fullmatch(p.name))
    if others:
        raise CheckpointError(
            f"cannot save a checkpoint to {directory}: it holds other files ({others[0]!r}), "
            "which replacing it would delete"
        )


def _move_into_place(tmp: Path, directory: Path) -> None:
    """Rename the complete `tmp` to `directory`. The old checkpoint is renamed aside first and
    removed last, so a kill at any point leaves one complete checkpoint (see `_readable`)."""
    _, old = _siblings(directory)
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)  # a killed save's, whose new one is in place
        os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_path(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def _readable(directory: Path) -> Path:
    """`directory`, or, where a save was killed between its two renames (`directory` gone),
    the previous checkpoint that save had moved aside."""
    _, old = _siblings(directory)
    if not directory.exists() and (old / "manifest.json").is_file():
        return old
    return directory


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(cpu, str(path))
    fsync_path(path)


def _verified(path: Path, expected: str) -> dict[str, torch.Tensor]:
    if not path.is_file() or sha256_file(path) != expected:
        raise CheckpointError(f"checkpoint file missing or corrupt (checksum): {path}")
    return _read(path)  # (the checksum may match a file that was never valid)


def _read(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from None


# ---- the manifest, checked before anything it names is read ------------------------------------
Dim = Annotated[int, Field(ge=0, lt=2**63)]  # a torch size


class _Unit(BaseModel):
    model_config = ConfigDict(strict=True)
    params: list[tuple[str, list[Dim]]] = Field(min_length=1)  # [name, shape]


class Manifest(BaseModel):
    """What `save_checkpoint` writes (strict: a string is not a number, nor a float an int)."""

    model_config = ConfigDict(strict=True)
    format: str
    step: int
    world_size: int = Field(ge=1)
    num_shards: int = Field(ge=1)
    strategy: str
    units: list[_Unit]
    sha256: dict[str, str]
    strategy_state_sha256: dict[str, str] = {}
    optimizer: str = ""  # (older checkpoints name none)

    def shard_files(self) -> list[str]:
        return [f"rank{r}.safetensors" for r in range(self.num_shards)]


def _expect_files(path: Path, field: str, listed: dict[str, str], expected: list[str]) -> None:
    """`listed` must name exactly `expected`: plain names, so nothing outside is ever read."""
    for name in listed:
        if name not in expected:
            raise CheckpointError(
                f"{path}: {field}: unexpected file name {name!r} "
                f"(expected {expected[0]} .. {expected[-1]})"
            )
    if len(listed) != len(expected):
        raise CheckpointError(
            f"{path}: {field} lists {len(listed)} files, expected {len(expected)} "
            f"({expected[0]} .. {expected[-1]})"
        )


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"not a complete shardwise checkpoint (no manifest): {directory}")
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint manifest {path}: {e.strerror}") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        raise CheckpointError(
            f"malformed checkpoint manifest {path}: {where!r}: {err['msg']}"
        ) from None
    if manifest.format != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.format!r}")
    _expect_files(path, "sha256", manifest.sha256, manifest.shard_files())
    if manifest.strategy_state_sha256:
        extra = [f"extra{r}.safetensors" for r in range(manifest.world_size)]
        _expect_files(path, "strategy_state_sha256", manifest.strategy_state_sha256, extra)
    return manifest


def _unit_pieces(names: list[str], shards: list[dict], i: int, key: str) -> list[torch.Tensor]:
    """`unit{i}/{key}` of every shard: all scalars, or all flat slices of one size."""
    pieces = []
    for name, shard in zip(names, shards, strict=True):
        piece = shard.get(f"unit{i}/{key}")
        if piece is None:
            raise CheckpointError(f"{name}: missing tensor unit{i}/{key}")
        if piece.dim() > 1 or piece.shape != (pieces[0] if pieces else piece).shape:
            raise CheckpointError(
                f"{name}: tensor unit{i}/{key} has shape {list(piece.shape)}, expected a "
                f"scalar or a flat slice of the shape of {names[0]}'s"
            )
        pieces.append(piece)
    return pieces


def read_full_state(directory: str | Path) -> tuple[dict, dict, int]:
    """Full per-parameter tensors: (params, optimizer state per parameter, step)."""
    directory = _readable(Path(directory))
    manifest = read_manifest(directory)
    paths = [directory / name for name in manifest.shard_files()]  # in rank order
    shards = [_verified(p, manifest.sha256[p.name]) for p in paths]
    units = [[(name, list(shape)) for name, shape in unit.params] for unit in manifest.units]
    params, states = assemble(units, shards, [str(p) for p in paths])
    return params, states, manifest.step


def assemble(
    units: list[list[tuple[str, list[int]]]],
    shards: list[dict[str, torch.Tensor]],
    names: list[str],
) -> tuple[dict, dict]:
    """Full per-parameter tensors (params and buffers; optimizer state per parameter) from every
    shard's flat slices of each unit (`checkpoint_shard`'s layout: `units`, each a list of
    (name, shape)); `names` say where each shard came from, for errors."""
    params = {k.removeprefix("buffer/"): v for k, v in shards[0].items() if k.startswith("buffer/")}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for i, unit in enumerate(units):
        keys = {k.split("/", 1)[1] for k in shards[0] if k.startswith(f"unit{i}/")} | {"param"}
        for key in sorted(keys):
            pieces = _unit_pieces(names, shards, i, key)
            if pieces[0].dim() == 0:  # a scalar (Adam's step): the same on every shard
                for name, _ in unit:
                    states.setdefault(name, {})[key] = pieces[0]
                continue
            flat = torch.cat(pieces)
            need = sum(math.prod(shape) for _, shape in unit)  # no int64 overflow
            if flat.numel() < need:
                raise CheckpointError(
                    f"{names[0]}: tensor unit{i}/{key} holds {flat.numel()} values on "
                    f"{len(names)} shard(s), the manifest's layout needs {need}"
                )
            offset = 0
            for name, shape in unit:
                n = math.prod(shape)
                full = flat[offset : offset + n].view(shape).clone()
                offset += n
                if key == "param":
                    params[name] = full
                else:
                    states.setdefault(name, {})[key] = full
    return params, states


def load_checkpoint(
    model: DistributedModel, optimizer: torch.optim.Optimizer, directory: str | Path
) -> int:
    """Load a sharded checkpoint saved at any world size; returns its step."""
    check_paired(model, optimizer)
    check_optimizer(directory, optimizer)  # (before its shards are read)
    params, states, step = read_full_state(directory)
    model.load_full_state(optimizer, params, states)
    _load_strategy_state(model, _readable(Path(directory)))
    return step


def check_optimizer(directory: str | Path, optimizer: torch.optim.Optimizer) -> None:
    """The sharded checkpoint at `directory` holds the state of `optimizer`'s class, where it
    says (an older one does not): an AdamW's moments loaded into an SGD, in silence, before."""
    saved_by = read_manifest(_readable(Path(directory))).optimizer
    if saved_by not in ("", optimizer_name(optimizer)):
        raise CheckpointError(
            f"{directory}: holds {saved_by} state, not this {optimizer_name(optimizer)}'s "
            "(its weights alone load into any optimizer: "
            "model.load_state_dict(shardwise.checkpoint.reshardable.full_weights(directory)))"
        )


def _load_strategy_state(model: DistributedModel, directory: Path) -> None:
    """This rank's strategy state, where the same strategy saved it on as many ranks; it
    cannot be resharded (a codec's residual is one rank's), so elsewhere it starts afresh."""
    manifest = read_manifest(directory)
    files = manifest.strategy_state_sha256
    rt = model.runtime
    same = manifest.strategy == model.checkpoint_name() and manifest.world_size == rt.world_size
    if files and same:
        name = f"extra{rt.rank}.safetensors"
        model.load_extra_state(_verified(directory / name, files[name]))
        return
    shared = {}
    if files and manifest.strategy == model.checkpoint_name():  # (on another number of ranks)
        shared = model.shared_extra_state(
            _verified(directory / "extra0.safetensors", files["extra0.safetensors"])
        )
        if shared:  # (counters, the loss scale: every rank's alike)
            model.load_extra_state(shared)
    if files and rt.is_main:
        kept = " but for what every rank held alike" if shared else ""
        print(
            f"shardwise: {directory}: strategy state of {manifest.strategy} on "
            f"{manifest.world_size} ranks not restored here{kept} (the rest starts afresh)",
            flush=True,
        )


def full_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's full (single-process) weights, whatever strategy and world saved it: a
    final checkpoint, a reshardable one, or a run's checkpoint (its reshardable part)."""
    directory = Path(directory)
    if (directory / "sharded" / "manifest.json").is_file():  # run_checkpoint.SHARDED
        directory = directory / "sharded"
    if (directory / WEIGHTS).is_file() and not (directory / "manifest.json").exists():
        return load_model(directory)  # a final checkpoint is already consolidated
    if (directory / "rank0.json").is_file():  # (a run checkpoint's own files, its part gone)
        raise CheckpointError(
            f"{directory}: a run checkpoint without its reshardable part "
            f"({directory / 'sharded' / 'manifest.json'} is missing)"
        )
    weights, _, _ = read_full_state(directory)
    return weights


def export_checkpoint(directory: str | Path, out: str | Path) -> Path:
    """Consolidate a checkpoint into one safetensors file of full fp32 weights."""
    out = Path(out)
    check_writable_file(out)  # (before reading a checkpoint that may be large)
    weights = full_weights(directory)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    try:
        _atomic(out, lambda p: save_file(weights, str(p), metadata={"format": "pt"}))
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {os_reason(e)}") from None
    except SafetensorError as e:  # (its writer's I/O errors: /proc and /sys refuse files)
        raise CheckpointError(f"cannot write {out}: {e}") from None
    return out
