"""Start a training job on this machine: its run directory, then its processes.

`run_job` is what `shardwise train` does outside a worker, and what the benchmarks call: it
creates the run directory (`runs/<name>-<time>` unless one is given), writes the resolved
config there, and starts the ranks, with torchrun's elastic agent, or, for a parameter-server
job, with our supervisor (which survives dead workers). Each rank then runs `trainer.train`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from shardwise.config import Config, ConfigError, dump_config
from shardwise.ps.worker import PSConfig


def new_run_dir(cfg: Config, requested: str | Path | None = None) -> Path:
    """`requested` (created if needed), or a new `runs/<name>-<time>[-k]`: two jobs started in
    the same second never share one (the directory is created exclusively)."""
    if requested:
        run_dir = Path(requested).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.launch.runs_dir).resolve() / f"{cfg.name}-{stamp}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 10_000):
        run_dir = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name beside {base}")


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
    return cfg


def run_job(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> int:
    """Run the job on `cfg.launch.nproc` local processes; 0 on success. A failed rank raises
    `LaunchError` (torchrun's agent stopped the others, after `launch.max_restarts` restarts);
    a failed parameter-server job returns 1 after saying why. With `resume` (or restarts),
    the ranks continue from the run directory's newest checkpoint."""
    from shardwise.launcher import launch

    cfg = fit_ranks(cfg, nproc_given=True)
    run_dir = new_run_dir(cfg, run_dir)
    resolved = run_dir / "config.yaml"
    resolved.write_text(dump_config(cfg))
    print(f"shardwise: {cfg.name} on {cfg.launch.nproc} rank(s), run directory {run_dir}")
    argv = ["shardwise", "train", str(resolved), "--run-dir", str(run_dir)]
    if resume or cfg.launch.max_restarts:  # a restarted rank resumes from the newest checkpoint
        argv.append("--resume")
    if isinstance(cfg.strategy, PSConfig):  # a supervisor of our own: a dead worker must not end it
        from shardwise.ps_supervisor import run_ps_job

        return run_ps_job(cfg, argv, run_dir)
    launch(argv, cfg.launch.nproc, cfg.launch.threads_per_rank, cfg.launch.max_restarts)
    return 0
