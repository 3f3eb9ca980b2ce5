"""How the tests run shardwise from outside, as a user does, and watch what it leaves running.

    run_cli("plan", "--json", timeout=60)     # `python -m shardwise plan --json`, to its end
    main_in_process(capsys, "plan", "--json") # the same through `cli.main`, in this process
    start_cli(*train_args(run, "a=1"))        # `... train digits --set a=1 --run-dir RUN` started
    start_entry_point("run", script)          # `shardwise run SCRIPT` as a shell starts it
    finish(job_a, job_b)                      # jobs started together, each's (code, output)
    run_ps_job(run, "a=1") / start_ps_job(..) # `... train digits --set strategy.name=ps ...`
    run_python(script) / start_python(...)    # plain Python: a script, torchrun's module
    wait_until(log.exists, job=job)           # poll; the deadline only bounds a failure
    processes_of(run) / none_left(run)        # the job's processes, from /proc; all gone

`run_cli` and `start_cli` run the command in a fork of a zygote of the test process, as a
launcher runs its ranks (`_shardwise`: what it spares, and the tests left out of it).
`run_*` capture stdout and stderr as text and time out after 240 s unless told otherwise;
`start_*` merge stderr into a stdout pipe unless told otherwise. Every command runs in the
test's environment plus `env`, with PYTHONUNBUFFERED=1: what it prints arrives as it prints it
(a job killed midway keeps its output; stdout merged with stderr stays in order). A test whose
commands must find no calibration of this machine uses the fixture `uncalibrated` (conftest).

Deadlines here only bound a failure, never slow a pass: on two shared cores a busy machine
stretches start-up and exit by many seconds, so each is far above what a pass takes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shardwise.distributed import boot, zygote

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL

# How long the processes of a job may take to be gone once they have been told to go.
GONE_WITHIN_S = 30.0


def _environment(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def set_args(*pairs: str) -> list[str]:
    """`--set KEY=VALUE` for each pair."""
    return [arg for kv in pairs for arg in ("--set", kv)]


def train_args(
    run_dir: Path | str | None,
    *pairs: str,
    config: str | None = "digits",
    nproc: int | None = None,
    measure: bool = False,
) -> list[str]:
    """The arguments of `shardwise train [CONFIG] [--nproc N] --set ... [--run-dir RUN_DIR]`.
    Without `measure` (and unless `pairs` say), `train.measure=false`: no prediction, meters
    or phase timing, which a test of anything else does not look at (a job starts ~1.4 s
    sooner on two cores: the prediction's fake tensors are most of it)."""
    args = ["train", *([config] if config else [])]
    args += ["--nproc", str(nproc)] if nproc is not None else []
    if not measure and not any(p.startswith("train.measure=") for p in pairs):
        pairs = ("train.measure=false", *pairs)
    args += set_args(*pairs)
    return args + (["--run-dir", str(run_dir)] if run_dir is not None else [])


def run_python(
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    text: bool = True,
    **kwargs,
) -> subprocess.CompletedProcess:
    """`python ARGS...` to its end, stdout and stderr captured (as text unless `text=False`)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_environment(env),
        capture_output=True,
        text=text,
        timeout=timeout,
        **kwargs,
    )


def start_python(
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    stdout=PIPE,
    stderr=STDOUT,
) -> subprocess.Popen:
    """`python ARGS...` started and left running; by default stderr merged into a stdout pipe."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=_environment(env),
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m shardwise ARGS...` to its end: `run_python`'s keywords (timeout 240 s)."""
    return run_python(*_shardwise(args, kwargs), **kwargs)


def main_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`shardwise ARGS...` through `cli.main` in this process, for a command that starts no
    job (a refusal, a plan, an export): no 2 s of imports a start. Its exit code and what it
    printed (stdout, stderr); what was printed before is dropped. An exception it let out, as
    a traceback would, fails the test."""
    from shardwise.cli import main

    capsys.readouterr()
    code = main(list(args))
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def start_entry_point(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """`shardwise ARGS...` started as a user's shell starts it: the console script the install
    made, a process of its own (`python -m shardwise` where pytest's Python has none); stdout
    and stderr as `start_python`'s."""
    script = Path(sys.executable).parent / "shardwise"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "shardwise"]
    kwargs.setdefault("stdout", PIPE)
    kwargs.setdefault("stderr", STDOUT)
    return subprocess.Popen([*command, *args], env=_environment(env), text=True, **kwargs)


def start_cli(*args: str, **kwargs) -> subprocess.Popen:
    """`python -m shardwise ARGS...` started: `start_python`'s keywords."""
    return start_python(*_shardwise(args, kwargs), **kwargs)


# A command is a fork of this test process's zygote (`distributed/zygote.py`, started at the
# first command), as a launcher's ranks are: `python boot.py -m shardwise ARGS` hands it its
# arguments, folder, environment and streams, passes on its signals and exits as it does. So
# each command skips Python's start and the imports (torch, its compiler stack, shardwise:
# ~3 s of CPU on these 2 cores, more than most commands' own work), and what runs is the same
# module. Left out: a test of a launcher's own processes (the `fresh_launchers` fixture: their
# command lines in /proc, signals as they start, the ports they listen on), a command with
# zygotes off (SHARDWISE_ZYGOTE=0), and one whose process is set up as it starts (`preexec_fn`:
# limits that a fork of another process would not have).
FRESH_LAUNCHERS = False
BOOT = boot.__file__  # (`python BOOT ARGS...` with `zygote_env()`: `python ARGS...`, forked)
_zygote: str | None = None  # its name, once started


def zygote_env() -> dict[str, str]:
    """The environment variable that has `BOOT` fork its command from this test process's
    zygote (started at the first call)."""
    global _zygote
    if _zygote is None:
        process, _zygote = zygote.start(["tests"], _environment(None))
        atexit.register(process.kill)  # (it dies with this process anyway: its parent)
    return {boot.ZYGOTE_ENV: _zygote}


def _shardwise(args: tuple[str, ...], kwargs: dict) -> list[str]:
    """`python`'s arguments for `shardwise ARGS`; `kwargs["env"]` names the zygote to fork."""
    env = kwargs.get("env") or {}
    if FRESH_LAUNCHERS or "preexec_fn" in kwargs or _environment(env).get(boot.ZYGOTE_ENV) == "0":
        return ["-m", "shardwise", *args]
    kwargs["env"] = {**env, **zygote_env()}
    return [BOOT, "-m", "shardwise", *args]


def finish(*jobs: subprocess.Popen, timeout: float = 240) -> list[tuple[int, str]]:
    """Each started job's (exit code, output) once it has ended. Jobs started together overlap
    their start-up and waits (a job's ranks rarely keep both cores busy): two at once take about
    two thirds of the time of one after the other."""
    ended = []
    try:
        for job in jobs:
            out, err = job.communicate(timeout=timeout)
            ended.append((job.returncode, out + (err or "")))
    finally:
        for job in jobs:
            job.kill()  # (one that hangs must not outlive its test)
    return ended


def ps_job_args(run_dir: Path, *pairs: str) -> list[str]:
    """The arguments of `shardwise train digits --set strategy.name=ps --set ... --run-dir
    RUN_DIR`: a parameter-server job, under our supervisor."""
    return train_args(run_dir, "strategy.name=ps", *pairs)


def start_ps_job(run_dir: Path, *pairs: str, **kwargs) -> subprocess.Popen:
    """A parameter-server job started: `start_python`'s keywords."""
    return start_cli(*ps_job_args(run_dir, *pairs), **kwargs)


def run_ps_job(run_dir: Path, *pairs: str, **kwargs) -> subprocess.CompletedProcess:
    """A parameter-server job to its end: `run_python`'s keywords."""
    return run_cli(*ps_job_args(run_dir, *pairs), **kwargs)


def wait_until(
    condition: Callable[[], object],
    timeout_s: float = 120,
    job: subprocess.Popen | None = None,
    every_s: float = 0.05,
    detail: Callable[[], str] = lambda: "",
) -> None:
    """Poll `condition` every `every_s` until it holds; fail if `job` ends first or `timeout_s`
    pass (with `detail()` in the message)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the job ended (exit code {job.returncode}) first; {detail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s; {detail()}")
        time.sleep(every_s)


# ---- the processes of a job, read from /proc -----------------------------------------------------
def processes_of(run_dir: Path) -> list[int]:
    """Pids whose command line names the run directory (every process of the job does)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(run_dir) in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def kill_processes_of(run_dir: Path) -> list[int]:
    """SIGKILL every process of the job (never leave them to the next test); their pids."""
    left = processes_of(run_dir)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # (gone meanwhile)
            os.kill(pid, signal.SIGKILL)
    return left


def none_left(run_dir: Path, after: str = "the job ended", within_s: float = GONE_WITHIN_S) -> None:
    """Every process of the job is gone within `within_s` (polled: a pass returns as soon as
    they are); those still there are killed, and named in the failure."""
    deadline = time.monotonic() + within_s
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = kill_processes_of(run_dir)
    assert left == [], f"processes of the job still running {within_s:.0f} s after {after}: {left}"


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (IPv4 or IPv6, hex as in /proc/net) that these processes listen on."""
    return {address for address, _ in _listening(pids)}


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports that these processes listen on."""
    return {port for _, port in _listening(pids)}


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # (gone meanwhile)
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.add((address, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
