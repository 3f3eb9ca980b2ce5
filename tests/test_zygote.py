"""Each rank of a job runs in a fork of the job's zygote (`distributed/zygote.py`), which
imported torch once: the process torchrun's agent started for the rank (`boot.py`) hands it the
rank and ends as the fork ends. Evidence from the kernel (parents, command lines, what is
alive), not from the zygote: the ranks' parent is one zygote, torch is imported before the
script's first line, the same job runs without one (`SHARDWISE_ZYGOTE=0`), a killed rank process
takes its fork with it, and a malformed request changes nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import finish, start_cli, wait_until
from shardwise.distributed import boot, launcher, zygote

pytestmark = pytest.mark.usefixtures("fresh_launchers")  # (what /proc shows of a launcher)

REPORT = """
    import json, os, sys
    preloaded = "torch" in sys.modules  # (before this script imports anything)
    import torch
    import shardwise as sw
    rt = sw.init()
    t = torch.tensor([float(rt.rank + 1)])
    sw.comm.all_reduce(t)
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
    name = open(f"/proc/{os.getppid()}/comm").read().strip()
    grandparent = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
    import numpy
    report = {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded,
              "parent": [a.decode() for a in parent if a], "sum": t.item(),
              "parent_name": name, "grandparent": grandparent,
              "name": open("/proc/self/comm").read().strip(),
              "numpy": float(numpy.random.random()),
              "threads": [torch.get_num_threads(), int(os.environ["OMP_NUM_THREADS"])],
              # (every thread's cores: gloo's threads are running by now)
              "cores": [sorted(os.sched_getaffinity(int(t)))
                        for t in os.listdir("/proc/self/task")]}
    open(os.path.join(sys.argv[1], f"rank{rt.rank}.json"), "w").write(json.dumps(report))
    sw.shutdown()
"""


def _reports(tmp_path: Path, env: dict[str, str] | None, *options: str) -> tuple[int, list[dict]]:
    """The launcher's pid, and what each rank reported."""
    script, out = tmp_path / "report.py", tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    script.write_text(textwrap.dedent(REPORT))
    out.mkdir()
    argv = ["run", "--nproc", "2", *options, str(script), str(out)]
    job = start_cli(*argv, env=env, cwd=tmp_path)
    [(code, output)] = finish(job)
    assert code == 0, output[-3000:]
    return job.pid, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_are_forks_of_one_zygote_and_the_job_is_the_same_without_it(tmp_path):
    # (the command's own threads: 2; its zygote starts with them, its ranks are to have 1 each)
    launcher, forked = _reports(tmp_path, {"OMP_NUM_THREADS": "2"})
    assert forked[0]["ppid"] == forked[1]["ppid"]  # one parent for both ranks
    # ... the zygote, a fork of the launcher (named for `ps`); the ranks keep the launcher's name
    assert forked[0]["parent_name"] == "sw-zygote" and forked[0]["grandparent"] == launcher
    assert forked[0]["parent"][1:3] == ["-m", "shardwise"], forked[0]["parent"]
    assert all(r["name"] != "sw-zygote" for r in forked)
    assert all(r["preloaded"] for r in forked)
    assert forked[0]["numpy"] != forked[1]["numpy"]  # seeded afresh, as a new process is
    # The zygote started before the job's threads were known (`entry.py`): each fork takes them
    # from its own environment, as a new process's OpenMP does.
    assert all(r["threads"] == [1, 1] for r in forked)
    usable = sorted(os.sched_getaffinity(0))
    assert all(cores == usable for r in forked for cores in r["cores"])  # (not bound: not asked)
    _, alone = _reports(tmp_path, {"SHARDWISE_ZYGOTE": "0"})
    for report in alone:  # each its own process, started by the launcher's agent
        assert report["parent"][1:3] == ["-m", "shardwise"], report["parent"]
    assert not any(r["preloaded"] for r in alone)
    assert [r["sum"] for r in forked] == [r["sum"] for r in alone] == [3.0, 3.0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_bound_ranks_run_every_thread_on_cores_of_their_own(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    per_rank = len(usable) // 2  # (the threads a rank gets by default: cores / ranks)
    expected = [usable[:per_rank], usable[per_rank : 2 * per_rank]]
    for env in (None, {"SHARDWISE_ZYGOTE": "0"}):  # a fork of the zygote; a process of its own
        _, ranks = _reports(tmp_path, env, "--bind-cores")
        for report, cores in zip(ranks, expected, strict=True):
            assert report["cores"] and all(c == cores for c in report["cores"]), report
        assert [r["sum"] for r in ranks] == [3.0, 3.0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores")
def test_ranks_that_cannot_each_have_their_cores_are_left_unbound_with_a_line(capsys):
    usable = len(os.sched_getaffinity(0))
    env = launcher.worker_environment(usable + 1, 1, bind_cores=True)
    assert not env[boot.CORES_ENV]  # (set empty: a binding the launcher inherited is not passed on)
    assert f"{usable + 1} ranks x 1 threads need {usable + 1} cores" in capsys.readouterr().err
    assert launcher.worker_environment(1, 1, bind_cores=True)[boot.CORES_ENV] == "1"
    assert not launcher.worker_environment(1, 1)[boot.CORES_ENV]  # (not asked)
    # A lone rank's default threads are every usable core: bound to all, it is bound to nothing.
    lone = launcher.worker_environment(1, None, bind_cores=True)
    assert lone["OMP_NUM_THREADS"] == str(usable) and not lone[boot.CORES_ENV]


SLEEPER = """
    import os, sys, time
    open(sys.argv[1], "w").write(str(os.getpid()))
    code = sys.argv[2]
    if code == "sleep":
        time.sleep(600)
    elif code == "SIGTERM":
        os.kill(os.getpid(), 15)
    sys.exit(int(code))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rank(script: Path, pid_file: Path, code: str, env: dict[str, str]) -> subprocess.Popen:
    """What an agent starts for a rank: `python boot.py SCRIPT ARGS`, here running `script`."""
    args = [sys.executable, launcher.BOOT, str(script), str(pid_file), code]
    return subprocess.Popen(args, env={**os.environ, **env})


OUTSIDER = """
import json, socket, sys
client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
client.connect("\\0" + sys.argv[1][1:])  # (an abstract name: '@' for its NUL)
request = {"argv": sys.argv[2:], "cwd": "/", "env": {}}
socket.send_fds(client, [json.dumps(request).encode()], [0, 1, 2])
client.settimeout(30)
try:
    reply = client.recv(4096)
except ConnectionResetError:  # (closed with the request unread: refused all the same)
    reply = b""
print(repr(reply))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a process as another user")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system python for nobody")
def test_another_users_request_is_refused_and_nothing_runs(tmp_path):
    """A well-formed request from user `nobody`: the zygote's socket has no file whose mode
    could keep it out, so the zygote asks the kernel who connected."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    os.chmod(tmp_path, 0o755)  # (nobody may read the script: only the zygote stops it)
    pid_file = tmp_path / "pid-nobody"
    with zygote.running([str(script)], dict(os.environ)) as env:
        # (/usr/bin/python3: this environment's interpreter may lie where nobody cannot go)
        argv = ["/usr/bin/python3", "-c", OUTSIDER, env["SHARDWISE_ZYGOTE"], str(script)]
        done = subprocess.run(
            [*argv, str(pid_file), "0"], user=65534, cwd="/", capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout.strip() == "b''", done.stderr[-2000:]
        # The same request from this user runs (the refusal was the user's, not the request's).
        rank = _rank(script, tmp_path / "pid-mine", "0", env)
        assert rank.wait(timeout=60) == 0 and (tmp_path / "pid-mine").exists()
    assert not pid_file.exists()


def test_a_fork_ends_as_its_rank_process_sees_and_dies_with_it(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    with zygote.running([str(script)], dict(os.environ)) as env:
        # Exit codes and signals come back as the fork's own.
        for code, want in (("0", 0), ("7", 7), ("SIGTERM", -signal.SIGTERM)):
            pid_file = tmp_path / f"pid-{code}"
            rank = _rank(script, pid_file, code, env)
            assert rank.wait(timeout=60) == want
            assert int(pid_file.read_text()) != rank.pid  # it ran in a fork
        # Requests that are not a rank's (not JSON; a wrong field; no descriptors) are
        # refused, the connection closed and nothing forked, and the zygote serves on.
        for data, fds in ((b"\xff not json", [0, 1, 2]), (b'{"argv": ["x"]}', [0, 1, 2])):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
                client.connect(boot.socket_address(env["SHARDWISE_ZYGOTE"]))
                socket.send_fds(client, [data], fds)
                client.settimeout(30)
                assert client.recv(4096) == b""
        # SIGKILL to the rank's process (what an agent does to a rank that will not stop): the
        # fork goes too, while the zygote lives on.
        pid_file = tmp_path / "pid-sleep"
        rank = _rank(script, pid_file, "sleep", env)
        wait_until(pid_file.exists, job=rank)
        fork = int(pid_file.read_text())
        assert _alive(fork)
        rank.kill()
        rank.wait()
        wait_until(lambda: not _alive(fork), timeout_s=10)
        # The next rank is served as the first was.
        rank = _rank(script, tmp_path / "pid-after", "3", env)
        assert rank.wait(timeout=60) == 3


def test_two_ranks_printing_at_once_never_cut_each_others_lines(tmp_path):
    """A line leaves a rank in one write: before, print's text and its newline were two, and
    another rank's line fell between them (18,376 of 40,000 lines spliced here)."""
    script = tmp_path / "prints.py"
    script.write_text(
        "import shardwise as sw\n"
        "rt = sw.init()\n"
        "for i in range(20000):\n"
        "    print(f'rank {rt.rank} line {i}')\n"
    )
    [(code, output)] = finish(start_cli("run", "--nproc", "2", str(script), cwd=tmp_path))
    assert code == 0, output[-3000:]
    lines = [line for line in output.splitlines() if " line " in line]
    assert len(lines) == 40000
    assert all(line.startswith("rank ") and line.count("line") == 1 for line in lines)


def test_a_rank_that_ends_before_joining_is_named_at_once(tmp_path):
    """Before, the other rank waited in the group's rendezvous for its 300 s, then failed with
    a store timeout that named nobody."""
    script = tmp_path / "leaves.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(0)\n"
        "import shardwise as sw\n"
        "sw.init()\n"
    )
    [(code, output)] = finish(
        start_cli("run", "--nproc", "2", str(script), cwd=tmp_path), timeout=60
    )
    assert code != 0
    assert "rank 1 ended (exit code 0) before joining the job (its sw.init())" in output


def test_a_rank_that_never_comes_is_named_after_the_timeout_not_twice_it():
    """Waiting in the job's store, then in the group's rendezvous, took twice the timeout."""
    import threading
    import time

    from shardwise.distributed import leaving

    store = __import__("torch").distributed.HashStore()
    started = time.monotonic()
    with pytest.raises(leaving.EndedBeforeJoining, match=r"^rank 1 never came before joining"):
        leaving.arrive(store, 0, 2, timeout_s=0.3)
    assert time.monotonic() - started < 1.0
    ended = threading.Timer(0.1, leaving.note_ended, (store.set, 2, 3))
    ended.start()  # (rank 2 ended with code 3 while rank 0 waited: said at once)
    with pytest.raises(leaving.EndedBeforeJoining, match=r"rank 2 ended \(exit code 3\)"):
        leaving.arrive(store, 0, 3, timeout_s=60)
    assert time.monotonic() - started < 5.0
