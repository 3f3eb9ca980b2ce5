"""The run directory: made once (never shared by two jobs by accident), agreed by every rank."""

from __future__ import annotations

import errno
import os
from datetime import datetime
from pathlib import Path

from shardwise.checkpoint import run_checkpoint
from shardwise.config import Config, ConfigError, dump_config
from shardwise.distributed import runtime
from shardwise.distributed.runtime import Runtime
from shardwise.observe.run_output import os_reason

RUN_DIR_KEY = "shardwise/run_dir"  # where rank 0 tells the others the run directory


def new_run_dir(cfg: Config, requested: str | Path | None = None) -> Path:
    """`requested` (created if needed), or a new `runs/<name>-<time>[-k]`: two jobs started in
    the same second never share one (the directory is created exclusively). A directory that
    cannot be created or written is a one-line `ConfigError`."""
    try:
        run_dir = _make_run_dir(cfg, requested)
    except OSError as e:
        where = f"--run-dir {requested}" if requested else f"launch.runs_dir {cfg.launch.runs_dir}"
        raise ConfigError(f"{where}: cannot create the run directory: {os_reason(e)}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"run directory {run_dir} is not writable")
    return run_dir


def _make_run_dir(cfg: Config, requested: str | Path | None) -> Path:
    if requested:
        run_dir = Path(requested).resolve()
        if run_dir.exists() and not run_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(run_dir))
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
    raise FileExistsError(f"no free run directory name beside {base}")


def agree_run_dir(cfg: Config, requested: str | None, rt: Runtime, resume: bool = False) -> Path:
    """Rank 0 picks (and creates) the directory, a new one unless `requested`; the others
    read its path from the job's store (plain text: no object crosses the wire). Two jobs
    never share one by accident. What killed saves left there is removed first; a resumed run
    changes nothing there before its checkpoint is loaded (`claim_run_dir`)."""
    store = runtime.store()
    if rt.is_main:
        path = new_run_dir(cfg, requested)
        if not resume:
            claim_run_dir(cfg, path)
        store.set(RUN_DIR_KEY, str(path))
    return Path(store.get(RUN_DIR_KEY).decode())


def claim_run_dir(cfg: Config, path: Path) -> None:
    """Rank 0: the run's resolved config, and nothing left of killed saves."""
    (path / "config.yaml").write_text(dump_config(cfg))
    run_checkpoint.remove_partial(path)
