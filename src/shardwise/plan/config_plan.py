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

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
ACCUMULATE = "accumulate"  # a candidate's train.accumulate, beside its strategy's options


def candidate_options(cfg: Config, model: nn.Module, nproc: int) -> dict[str, dict]:
    """Exact strategies for `cfg`'s `model` on `nproc` ranks, each a `strategy:` section's
    options by name (and `accumulate`: its train.accumulate), with and without activation
    checkpointing: DDP (native, ring), ZeRO 1-3, HSDP (ZeRO-3 over groups of 2), DDP and
    ZeRO-3 accumulating 2 micro-batches, and where the model splits, tensor parallel, the four
    pipeline schedules, and dp x tp, dp x pp (DDP or ZeRO-3 along dp) and dp x tp x pp
    meshes."""
    found = {
        "ddp": {"name": "ddp"},
        "ddp-ring": {"name": "ddp", "algorithm": "ring"},
        **{f"zero{s}": {"name": "zero", "stage": s} for s in (1, 2, 3)},
    }
    if nproc >= 4 and nproc % 2 == 0:  # HSDP: pairs of ranks shard, the pairs replicate
        found["hsdp2"] = {"name": "zero", "stage": 3, "shard_group": 2}
    if cfg.data.batch_size >= 2:  # each rank's batch in two micro-batches
        found["ddp+acc2"] = {"name": "ddp", ACCUMULATE: 2}
        found["zero3+acc2"] = {"name": "zero", "stage": 3, ACCUMULATE: 2}
    heads = getattr(cfg.model, "n_head", 0) if cfg.model.name == "gpt" else 0
    try:
        layers = len(pipeline_layers(model))
    except ValueError:
        layers = 0
    splits_tp = heads and hasattr(model, "TP_PLAN")
    for split in divisors(nproc)[1:]:
        dp = nproc // split
        mesh = {"name": "mesh", "dp": dp}
        if splits_tp and heads % split == 0:
            if dp == 1:
                found[f"tp{split}"] = {"name": "tp"}
            else:
                found[f"dp{dp}-tp{split}"] = {**mesh, "tp": split}
                found[f"dp{dp}-tp{split}-zero3"] = {**mesh, "tp": split, "data": "zero3"}
        for schedule in SCHEDULES:
            chunks = 2 if schedule == "interleaved" else 1  # (v = 2 model chunks a rank)
            if chunks > 1 and 4 % split:  # (its 4 micro-batches: a multiple of the stages)
                continue
            if layers < split * chunks or not _pipelines(model, split * chunks):
                continue
            name = f"pp{split}-{schedule}" if dp == 1 else f"dp{dp}-pp{split}-{schedule}"
            pp = {"name": "pp"} if dp == 1 else {**mesh, "pp": split}
            found[name] = {**pp, "schedule": schedule}
            if dp > 1 and schedule in ("gpipe", "1f1b"):  # (ZeRO-2/3 reduce once, after all)
                found[f"{name}-zero3"] = {**pp, "schedule": schedule, "data": "zero3"}
        for pp in divisors(split)[1:-1] if splits_tp else []:  # dp x tp x pp
            tp = split // pp
            if heads % tp == 0 and layers >= pp and _pipelines(model, pp):
                found[f"dp{dp}-tp{tp}-pp{pp}"] = {**mesh, "tp": tp, "pp": pp}
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
    return [
        f"train.accumulate={value}" if key == ACCUMULATE else f"strategy.{key}={_scalar(value)}"
        for key, value in options.items()
    ]


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
    """`cfg` with the strategy `options` on `nproc` ranks, each data-parallel replica taking
    its share of the global batch of `cfg`'s batch on every rank (model-parallel ranks share
    one), validated as a whole (a one-line `ConfigError` where the config refuses it)."""
    whole = cfg.data.batch_size * nproc
    first = _candidate(cfg, options, nproc, whole)
    # (what divides a replica's batch divides the global one: the first refuses no more)
    batch = whole // replicas(first.strategy, nproc)
    return first if batch == whole else _candidate(cfg, options, nproc, batch)


def _candidate(cfg: Config, options: dict, nproc: int, batch_size: int) -> Config:
    own = cfg.strategy.model_dump() if options["name"] == cfg.strategy.name else {}
    launch = cfg.launch.model_copy(update={"nproc": nproc})
    strategy = {k: v for k, v in options.items() if k != ACCUMULATE}
    train = cfg.train.model_copy(update={"accumulate": options.get(ACCUMULATE, 1)})
    data = cfg.data.model_copy(update={"batch_size": batch_size})
    return validate(
        {
            **dict(cfg),
            "strategy": {**own, **strategy},
            "launch": launch,
            "train": train,
            "data": data,
        }
    )


class MetaJob:
    """A config's job as the planner prices it: built once, on the meta device, seen as rank 0
    of `nproc` ranks at the global batch of the config's batch on every rank (model-parallel
    ranks share a batch)."""

    def __init__(self, cfg: Config, nproc: int) -> None:
        plain = cfg.strategy.model_copy(update={"activation_checkpointing": False})
        job = build_job(cfg.model_copy(update={"strategy": plain}), device="meta")
        self.nproc = nproc
        self.global_batch = cfg.data.batch_size * nproc
        self.cost_job = replace(
            CostJob.of(job, cfg, nproc, 0, self.global_batch), traces={}
        )  # (its model's traces, shared by the strategies it prices)
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
        model = self.model(strategy.activation_checkpointing)
        job = replace(self.cost_job, model=model, accumulate=cfg.train.accumulate)
        predicted = prediction.for_run(job, strategy, calibration)
        predicted["batch_size"] = self.global_batch // replicas(strategy, self.nproc)
        return predicted


def price_candidates(
    cfg: Config, nproc: int, calibration: dict, refused: dict[str, str] | None = None
) -> list[dict]:
    """Every candidate for `cfg` on `nproc` ranks, priced on one meta job: a row each, fastest
    predicted first. One the config refuses is left out, and why goes in `refused`."""
    job = MetaJob(cfg, nproc)
    rows = []
    for name, options in candidate_options(cfg, job.model(False), nproc).items():
        try:
            candidate = candidate_config(cfg, options, nproc)
        except ConfigError as e:
            if refused is not None:
                refused[name] = str(e).splitlines()[0]
            continue
        predicted = job.price(candidate, calibration)
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
    refused: dict[str, str] = {}
    try:
        cfg = load_config(config, user_sets)
        started = time.perf_counter()
        rows = price_candidates(cfg, nproc, calibration, refused)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not rows:
        raise ValueError(f"the config refuses every strategy on {nproc} ranks: {refused}")
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
    for name, why in refused.items():
        print(f"    {name}: not priced ({why})")
    first = rows[0]
    batch = (
        []
        if first["batch_size"] == cfg.data.batch_size
        else [f"data.batch_size={first['batch_size']}"]
    )
    sets = " ".join(f"--set {kv}" for kv in [*user_sets, *first["sets"], *batch])
    print(f"run the first: shardwise train {config} --nproc {nproc} {sets}")
    return 0
