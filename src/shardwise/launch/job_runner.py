"""Start a training job on this machine: its run directory, then its processes.

`run_job` is what `shardwise train` does outside a worker, and what the benchmarks call: it
creates the run directory (`runs/<name>-<time>` unless one is given), writes the resolved
config there, and starts the ranks, with torchrun's elastic agent, or, for a parameter-server
job, with our supervisor (which survives dead workers). Each rank then runs `train_rank`.
A resume first checks, before it writes anything, that the run's checkpoint fits the config.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from shardwise.config import Config, ConfigError, dump_config
from shardwise.faults.injection import parse as parse_faults
from shardwise.observe.run_output import os_reason
from shardwise.ps.worker import PSConfig
from shardwise.train.ps_training import run_role
from shardwise.train.run_dir import new_run_dir
from shardwise.train.trainer import train


def fit_ranks(cfg: Config, nproc_given: bool = False) -> Config:
    """The config with `launch.nproc` the strategy's own where it fixes one (the roles of a
    parameter-server job, unless given); a one-line error where they disagree."""
    needed = cfg.strategy.ranks_needed()
    if isinstance(cfg.strategy, PSConfig) and not nproc_given:
        cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"nproc": needed})})
    if needed is not None and needed != cfg.launch.nproc:
        raise ConfigError(
            f"config error: strategy {cfg.strategy.name!r} needs {needed} ranks, "
            f"but launch.nproc is {cfg.launch.nproc}"
        )
    try:  # (what a rank would find only once started: the run directory made, then failed)
        cfg.strategy.check_world(cfg.launch.nproc)
    except ValueError as e:
        raise ConfigError(f"config error: strategy: {e}") from None
    for fault in parse_faults(",".join(cfg.faults), source=""):  # (one that never fires)
        if fault.rank is not None and fault.rank >= cfg.launch.nproc:
            raise ConfigError(
                f"config error: faults: {fault.kind} on rank {fault.rank}, in a job of "
                f"{cfg.launch.nproc} ranks"
            )
    weights, replicas = cfg.data.rank_weights, cfg.strategy.data_parallel_ranks(cfg.launch.nproc)
    if weights is not None and len(weights) != replicas:
        raise ConfigError(
            f"config error: data.rank_weights has {len(weights)} weights for {replicas} "
            f"data-parallel ranks"
        )
    if len(cfg.train.delay_s) > replicas:  # (a delay for a rank the job has not: never used)
        raise ConfigError(
            f"config error: train.delay_s has {len(cfg.train.delay_s)} delays for {replicas} "
            f"data-parallel ranks (one per rank at most)"
        )
    return cfg


def train_rank(cfg: Config, run_dir: str | None, resume: bool) -> None:
    """What one rank of a job started by `run_job` (or torchrun) runs: the trainer, or, in a
    parameter-server job, this rank's role (its supervisor sums up)."""
    if isinstance(cfg.strategy, PSConfig):
        run_role(cfg, run_dir)
    else:
        train(cfg, run_dir, resume=resume)


def run_job(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> int:
    """Run the job on `cfg.launch.nproc` local processes; 0 on success. A failed rank raises
    `LaunchError` (torchrun's agent stopped the others, after `launch.max_restarts` restarts);
    a failed parameter-server job returns 1 after saying why. With `resume` (or restarts),
    the ranks continue from the run directory's newest checkpoint."""
    from shardwise.distributed.launcher import launch

    cfg = fit_ranks(cfg, nproc_given=True)
    ps = isinstance(cfg.strategy, PSConfig)
    if resume and not ps:
        check_resume(cfg, Path(run_dir))
    else:
        if run_dir is not None and not ps:
            refuse_other_runs(Path(run_dir))
        check_start(cfg)
    make_offload_dir(cfg)
    run_dir = new_run_dir(cfg, run_dir)
    print(f"shardwise: {cfg.name} on {cfg.launch.nproc} rank(s), run directory {run_dir}")
    # A resume's ranks write config.yaml once their checkpoint is loaded: until then nothing in
    # the run directory changes (a checkpoint too old to record its job is checked then).
    with _resolved_config(cfg, run_dir, in_run_dir=not resume or ps) as resolved:
        argv = ["shardwise", "train", str(resolved), "--run-dir", str(run_dir)]
        if resume or cfg.launch.max_restarts:  # a restarted rank resumes from the newest one
            argv.append("--resume")
        if ps:  # a supervisor of our own: a dead worker must not end it
            from shardwise.launch.ps_supervisor import run_ps_job

            return run_ps_job(cfg, argv, run_dir)
        launch(
            argv,
            cfg.launch.nproc,
            cfg.launch.threads_per_rank,
            cfg.launch.max_restarts,
            cfg.train.on_failure,
            cfg.launch.bind_cores,
        )
    return 0


@contextlib.contextmanager
def _resolved_config(cfg: Config, run_dir: Path, in_run_dir: bool):
    """The resolved config as a file the ranks read: RUN_DIR/config.yaml, or a temporary file
    removed afterwards."""
    path = run_dir / "config.yaml"
    if not in_run_dir:
        fd, name = tempfile.mkstemp(prefix=f"shardwise-{cfg.name}-", suffix=".yaml")
        os.close(fd)
        path = Path(name)
    try:
        _write(path, dump_config(cfg))
        yield path
    finally:
        if not in_run_dir:
            path.unlink(missing_ok=True)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {os_reason(e)}") from None


# What a run writes into its directory as it trains: a new job there would add its own
# lines to another run's metrics and timings, and take its fired faults' markers for its own.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "timing", "tensorboard", "faults")


def refuse_other_runs(run_dir: Path) -> None:
    """A new job does not train into a run directory that holds another run's checkpoints
    (its own saves would be pruned as older than them, and a restart or a later --resume would
    continue the other run) or outputs (metrics and timings mixed, faults already fired): a
    one-line `ConfigError`."""
    from shardwise.checkpoint import run_checkpoint

    if found := run_checkpoint.complete(run_dir / "checkpoints"):
        raise ConfigError(
            f"--run-dir {run_dir} holds another run's checkpoints (the newest {found[-1].name}):"
            f" --resume {run_dir} continues it; a new job needs another --run-dir"
        )
    if written := [name for name in RUN_OUTPUTS if (run_dir / name).exists()]:
        raise ConfigError(
            f"--run-dir {run_dir} holds another run's outputs ({', '.join(written)}): a new job "
            f"needs another --run-dir (--resume {run_dir} goes on there, afresh where no "
            "checkpoint was saved)"
        )


def check_start(cfg: Config) -> None:
    """A run that starts from another run's checkpoint (`start:`): that it is there."""
    if cfg.start is not None and not Path(cfg.start.checkpoint).exists():
        raise ConfigError(f"config error: start.checkpoint: no such path {cfg.start.checkpoint}")


def make_offload_dir(cfg: Config) -> None:
    """The directory given for state offloaded to disk, made now (each rank makes its own in
    it): where it cannot be, one line before any rank starts."""
    if (where := cfg.strategy.disk_offload_dir()) is not None:
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"config error: strategy.offload_dir: {os_reason(e)}") from None


def _finished_at(run_dir: Path) -> int | None:
    """The step a run finished at (its final weights' meta.json), or None where it has not."""
    try:
        step = json.loads((run_dir / "checkpoint" / "meta.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def check_resume(cfg: Config, run_dir: Path) -> None:
    """Before a resume starts any rank, and before anything in `run_dir` changes: the checkpoint
    it will resume from was saved by the job `cfg` describes (the same model, optimizer and
    strategy) on a number of ranks it can resume on; a one-line `ConfigError` where not."""
    from shardwise.checkpoint import run_checkpoint
    from shardwise.jobs import build_job

    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise ConfigError(f"--resume {run_dir}: {checkpoints} is not a directory")
    # A run that finished has its summary and final weights, which a resume writes over: only
    # to train further (a run stopped at its last step, before those, resumes).
    finished, steps = _finished_at(run_dir), cfg.train.steps
    start_from = f"start a new run from it (--set start.checkpoint={run_dir} --set start.mode="
    if finished is not None and finished >= steps:
        raise ConfigError(
            f"--resume {run_dir}: the run finished at step {finished}, train.steps is {steps}: "
            f"raise train.steps to train further, or {start_from}continue)"
        )
    if not run_checkpoint.complete(checkpoints):
        if finished is not None:  # (from step 0, over its final weights)
            raise ConfigError(
                f"--resume {run_dir}: the run finished and saved no checkpoint to resume "
                f"from; to train further, {start_from}finetune)"
            )
        check_start(cfg)  # (nothing to resume from: the ranks start afresh, from `start:`)
        return
    job = run_checkpoint.job_signature(build_job(cfg).model, cfg.optim.name, cfg.strategy.name)
    try:
        found = run_checkpoint.resumable(run_dir, cfg.launch.nproc, job)
    except run_checkpoint.RunCheckpointError as e:
        raise ConfigError(f"--resume {run_dir}: {e}") from None
    if found is not None and found.step > steps:
        raise ConfigError(
            f"--resume {run_dir}: its newest checkpoint is at step {found.step}, past "
            f"train.steps={steps}: raise train.steps, or {start_from}continue)"
        )
