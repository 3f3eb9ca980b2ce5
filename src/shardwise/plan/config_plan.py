"""A config on this machine: every exact strategy shardwise runs for its model, priced at the
calibrated rates and ranked by predicted step time (`shardwise plan --config NAME --nproc N`).

The config is loaded once. Each candidate is a `strategy:` section, applied to it as the
config's own sections are validated (no YAML re-read): a candidate of the config's strategy
keeps that section's options, another starts from its defaults, as `--set strategy.name=...`
does. Every candidate is priced on one job, built once on the meta device (shapes, no storage):
the candidates that recompute activations use a copy of its model with those regions patched.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from torch import nn

from shardwise.config import Config, ConfigError, load_config, validate
from shardwise.jobs import build_job
from shardwise.nn.recompute import Spec, checkpoint_activations, copy_model
from shardwise.plan import calibrate, prediction
from shardwise.plan.costs import CostJob
from shardwise.plan.predictors import replicas
from shardwise.plan.search import divisors
from shardwise.strategies.pipeline import Pipeline, check_stages
from shardwise.strategies.pipeline_stages import pipeline_layers


def candidate_options(cfg: Config, model: nn.Module, nproc: int) -> dict[str, dict]:
    """Exact strategies for `cfg`'s `model` on `nproc` ranks, each a `strategy:` section's
    options by name, with and without activation checkpointing: DDP (native, ring), ZeRO 1-3,
    and where the model splits, tensor parallel, both pipeline schedules and dp x tp / dp x pp
    meshes."""
    found = {
        "ddp": {"name": "ddp"},
        "ddp-ring": {"name": "ddp", "algorithm": "ring"},
        **{f"zero{s}": {"name": "zero", "stage": s} for s in (1, 2, 3)},
    }
    heads = getattr(cfg.model, "n_head", 0) if cfg.model.name == "gpt" else 0
    try:
        layers = len(pipeline_layers(model))
    except ValueError:
        layers = 0
    for split in divisors(nproc)[1:]:
        dp = nproc // split
        mesh = {"name": "mesh", "dp": dp}
        if heads and heads % split == 0 and hasattr(model, "TP_PLAN"):
            tp = {"name": "tp"} if dp == 1 else {**mesh, "tp": split}
            found[f"tp{split}" if dp == 1 else f"dp{dp}-tp{split}"] = tp
        if layers >= split and _pipelines(model, split):
            for schedule in ("gpipe", "1f1b"):
                name = f"pp{split}-{schedule}" if dp == 1 else f"dp{dp}-pp{split}-{schedule}"
                pp = {"name": "pp"} if dp == 1 else {**mesh, "pp": split}
                found[name] = {**pp, "schedule": schedule}
    with_ckpt = {
        f"{name}+ckpt": {**options, "activation_checkpointing": True}
        for name, options in found.items()
        if cfg.model.name == "gpt"
    }
    return {**found, **with_ckpt}


def _pipelines(model: nn.Module, stages: int) -> bool:
    """Whether the model splits into `stages` stages that each hold parameters."""
    layers = pipeline_layers(model)
    try:
        check_stages(layers, [*Pipeline(stages=stages).stage_starts(layers), len(layers)])
    except ValueError:
        return False
    return True


def as_sets(options: dict) -> list[str]:
    """A candidate's options as `--set` overrides (what `shardwise train` takes)."""
    return [f"strategy.{key}={_scalar(value)}" for key, value in options.items()]


def _scalar(value: object) -> str:
    """`value` as YAML writes a scalar (`--set` values are read as YAML)."""
    return {True: "true", False: "false"}[value] if isinstance(value, bool) else str(value)


def config_candidates(cfg: Config, nproc: int) -> dict[str, list[str]]:
    """`candidate_options` for `cfg`'s model (built on the meta device), as `--set` overrides."""
    model = build_job(cfg, device="meta").model
    return {
        name: as_sets(options) for name, options in candidate_options(cfg, model, nproc).items()
    }


def candidate_config(cfg: Config, options: dict, nproc: int) -> Config:
    """`cfg` with the strategy `options` on `nproc` ranks, validated as a whole (a one-line
    `ConfigError` where the config refuses it)."""
    own = cfg.strategy.model_dump() if options["name"] == cfg.strategy.name else {}
    launch = cfg.launch.model_copy(update={"nproc": nproc})
    return validate({**dict(cfg), "strategy": {**own, **options}, "launch": launch})


class MetaJob:
    """A config's job as the planner prices it: built once, on the meta device, seen as rank 0
    of `nproc` ranks at the global batch of the config's batch on every rank (model-parallel
    ranks share a batch)."""

    def __init__(self, cfg: Config, nproc: int) -> None:
        plain = cfg.strategy.model_copy(update={"activation_checkpointing": False})
        job = build_job(cfg.model_copy(update={"strategy": plain}), device="meta")
        self.nproc = nproc
        self.global_batch = cfg.data.batch_size * nproc
        self.cost_job = CostJob.of(job, cfg, nproc, 0, self.global_batch)
        self.models: dict[bool | tuple[str, ...], nn.Module] = {False: job.model}

    def model(self, spec: Spec) -> nn.Module:
        """The model with the regions `spec` names recomputed (a copy, made once per `spec`)."""
        key = spec if isinstance(spec, bool) else tuple(spec)
        if key not in self.models:
            twin = copy_model(self.models[False])
            checkpoint_activations(twin, spec)
            self.models[key] = twin
        return self.models[key]

    def price(self, cfg: Config, calibration: dict) -> dict:
        """Rank 0's predicted costs and step time under `cfg` (a candidate's config), and the
        batch each replica takes (`batch_size`: what `--set data.batch_size` must say)."""
        strategy = cfg.strategy
        job = replace(self.cost_job, model=self.model(strategy.activation_checkpointing))
        predicted = prediction.for_run(job, strategy, calibration)
        predicted["batch_size"] = self.global_batch // replicas(strategy, self.nproc)
        return predicted


def price_candidates(cfg: Config, nproc: int, calibration: dict) -> list[dict]:
    """Every candidate for `cfg` on `nproc` ranks, priced on one meta job: a row each, fastest
    predicted first."""
    job = MetaJob(cfg, nproc)
    rows = []
    for name, options in candidate_options(cfg, job.model(False), nproc).items():
        predicted = job.price(candidate_config(cfg, options, nproc), calibration)
        rows.append(
            {
                "strategy": name,
                "sets": as_sets(options),
                "batch_size": predicted["batch_size"],
                "memory_bytes": predicted["memory"]["total"] + (predicted["activations"] or 0),
                "comm_bytes_per_step": predicted.get("comm_bytes_per_step", 0),
                "step_time_s": predicted["step_time_s"]["total"],
                "parts": predicted["step_time_s"],
            }
        )
    rows.sort(key=lambda r: r["step_time_s"])
    return rows


def plan_config(config: str, user_sets: list[str], nproc: int, as_json: bool, top: int) -> int:
    """`shardwise plan --config`: every exact strategy for `config` (with `user_sets`) on
    `nproc` ranks of this machine, ranked by the predicted step time at its calibration."""
    calibration = calibrate.load(nproc)
    if calibration is None:
        raise ValueError(
            f"no calibration for {nproc} ranks on this machine: run shardwise calibrate "
            f"--nproc {nproc}"
        )
    try:
        cfg = load_config(config, user_sets)
        started = time.perf_counter()
        rows = price_candidates(cfg, nproc, calibration)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if as_json:
        print(json.dumps(rows))
        return 0
    print(
        f"{config} on {nproc} ranks of this machine, {len(rows)} strategies priced in "
        f"{time.perf_counter() - started:.1f} s (rank 0: model state + activations; "
        f"{calibrate.age_note(calibration)})"
    )
    print(f"{'#':>3} {'strategy':22s} {'step ms':>8} {'memory MiB':>11} {'comm MiB':>9}")
    for i, row in enumerate(rows[:top], 1):
        print(
            f"{i:>3} {row['strategy']:22s} {1000 * row['step_time_s']:8.1f} "
            f"{row['memory_bytes'] / 2**20:11.1f} {row['comm_bytes_per_step'] / 2**20:9.2f}"
        )
    sets = " ".join(f"--set {kv}" for kv in [*user_sets, *rows[0]["sets"]])
    print(f"run the first: shardwise train {config} --nproc {nproc} {sets}")
    return 0
