"""Config sections: typed, validated fields, each with a description (pydantic models).

A strategy declares its YAML section beside its options, in its own module: a `StrategySection`
whose `name` picks it and whose `build` makes the strategy. `config.py` assembles the sections
into one `Config`; nothing else needs to know the strategy exists.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

if TYPE_CHECKING:
    from shardwise.strategies.base import Strategy


class Section(BaseModel):
    # No field means "never" by infinity: a timeout of .inf would overflow where it is used.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, given: Any) -> Any:
        # pydantic reads YAML's `true` as the number 1: `steps: true` would train one step,
        # `stage: true` be stage 1, `skip_batches: [true]` skip the first batch.
        for name, value in given.items() if isinstance(given, dict) else ():
            field = cls.model_fields.get(name)
            if field is not None and _boolean_for_a_number(field.annotation, value):
                raise ValueError(f"{name} takes numbers, not booleans: got {value!r}")
        return given


def _boolean_for_a_number(kind: Any, value: Any) -> bool:
    """Whether `value` is, or holds, a boolean where type `kind` takes a number."""
    origin = get_origin(kind)
    if origin is Annotated:
        return _boolean_for_a_number(get_args(kind)[0], value)
    if isinstance(value, bool):
        return _a_number(kind)
    if origin in (Union, UnionType):
        return any(_boolean_for_a_number(k, value) for k in get_args(kind))
    if origin in (list, tuple) and isinstance(value, list | tuple) and get_args(kind):
        return any(_boolean_for_a_number(get_args(kind)[0], item) for item in value)
    return False


def check_options(options: Any, section: type[Section], skip: frozenset[str] = frozenset()) -> None:
    """The Python API's options (a strategy's dataclass) checked by the types and bounds of the
    YAML section that describes them, field by field, strictly: no string, boolean or float for
    a whole number (`sw.DDP(bucket_mb="25")`, `sw.ZeRO(stage=True)`, `group_size=2.5` were
    taken, to fail deep inside, or never). `skip`: fields the dataclass types otherwise (a
    strategy object where the YAML names one). A `ValueError` naming the field, one line."""
    for name in (f.name for f in dataclasses.fields(options)):
        field = section.model_fields.get(name)
        if field is None or name in skip:
            continue
        value = getattr(options, name)
        where = f"{type(options).__name__}({name}={value!r})"
        if isinstance(value, os.PathLike):  # (a `Path` where the YAML writes a string: taken)
            value = os.fspath(value)
        if _boolean_for_a_number(field.annotation, value):
            raise ValueError(f"{where}: takes numbers, not booleans")
        try:  # (a tuple where the section lists: the same values)
            _field_type(section, name).validate_python(
                list(value) if isinstance(value, tuple) else value, strict=True
            )
        except ValidationError as e:
            error = e.errors()[0]
            if error["type"] == "string_pattern_mismatch":
                continue  # (a regex says less than the strategy's own check of the spec, next)
            raise ValueError(f"{where}: {error['msg']}") from None


@functools.cache
def _field_type(section: type[Section], name: str) -> TypeAdapter:
    field = section.model_fields[name]
    kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(kind, config=_NO_INF_NAN)


_NO_INF_NAN = ConfigDict(allow_inf_nan=False)  # (`Section`'s: its fields' types alone lack it)


def _a_number(kind: Any) -> bool:
    """Whether a value of type `kind` is a number, never a boolean (`int | None`, `Literal[1,
    2]`, `NonNegativeFloat`)."""
    origin = get_origin(kind)
    if origin is Annotated:
        return _a_number(get_args(kind)[0])
    if origin is Literal:
        return all(type(v) in (int, float) for v in get_args(kind))
    if origin in (Union, UnionType):
        kinds = [k for k in get_args(kind) if k is not type(None)]
        return bool(kinds) and all(_a_number(k) for k in kinds)
    return kind in (int, float)


class StrategySection(Section):
    """The `strategy:` section of one strategy (`name` is its discriminator)."""

    name: str
    activation_checkpointing: bool | list[str] = Field(
        False,
        description="recompute activations in backward instead of keeping them: true (the "
        "model's blocks; TinyGPT: each transformer block) or module name patterns "
        "(e.g. ['blocks.*.mlp'])",
    )

    def build(self, world_size: int, run_dir: Path) -> Strategy:
        """The strategy these options describe, for a job of `world_size` ranks whose outputs
        (offload files, snapshots) go under `run_dir`."""
        raise NotImplementedError

    def ranks_needed(self) -> int | None:
        """The world size the options fix, where they fix one (model parallel, PS roles)."""
        return None

    def check_world(self, world_size: int) -> None:
        """A `ValueError` where the options cannot run on `world_size` ranks: before any rank
        starts (`ranks_needed` is checked beside it)."""

    def disk_offload_dir(self) -> str | None:
        """The directory given for state offloaded to disk, if any (made before ranks start)."""
        return None

    def data_parallel_ranks(self, world_size: int) -> int:
        """The ranks of `world_size` that each take a slice of the global batch."""
        return world_size

    def describe(self) -> str:
        """A few words for the summary table."""
        return self.name

    def options(self, exclude: set[str] = frozenset()) -> dict:
        """The fields that map one to one onto the strategy's options."""
        return self.model_dump(exclude={"name", "activation_checkpointing", *exclude})
