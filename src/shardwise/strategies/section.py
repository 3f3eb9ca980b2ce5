"""Config sections: typed, validated fields, each with a description (pydantic models).

A strategy declares its YAML section beside its options, in its own module: a `StrategySection`
whose `name` picks it and whose `build` makes the strategy. `config.py` assembles the sections
into one `Config`; nothing else needs to know the strategy exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from shardwise.strategies.base import Strategy


class Section(BaseModel):
    # No field means "never" by infinity: a timeout of .inf would overflow where it is used.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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

    def data_parallel_ranks(self, world_size: int) -> int:
        """The ranks of `world_size` that each take a slice of the global batch."""
        return world_size

    def describe(self) -> str:
        """A few words for the summary table."""
        return self.name

    def options(self, exclude: set[str] = frozenset()) -> dict:
        """The fields that map one to one onto the strategy's options."""
        return self.model_dump(exclude={"name", "activation_checkpointing", *exclude})
