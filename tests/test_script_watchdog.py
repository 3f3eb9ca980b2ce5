"""A user's script under `shardwise run` gets the trainer's watchdog: a rank that hangs, or that
leaves the job early, ends every rank within seconds, and the launcher's last line names that
rank (not the rank that waited for it, as the backend's own timeout would). Nothing of the job
is left in the temporary directory (torchrun's agent writes its logs there) nor in the working
one."""

from __future__ import annotations

import textwrap
import time

import pytest

from harness import run_cli

pytestmark = pytest.mark.alone  # (a 4 s hang timeout, and bounds in seconds)

SCRIPT = """
    import os, sys, time, torch
    import shardwise as sw
    rt = sw.init(timeout_s=300)  # the backend's own timeout: far longer than the test allows
    # (the agent's logs are in the job's TMPDIR while it runs: that folder is the one checked)
    assert any(p.startswith("shardwise-agent-") for p in os.listdir(os.environ["TMPDIR"]))
    t = torch.ones(3)
    for step in range(5):
        sw.comm.all_reduce(t)
    if rt.rank == 1:
        {fault}
    sw.comm.all_reduce(t)  # rank 1 never comes
    sw.shutdown()
"""
FAULTS = {
    "leaves": "sys.exit(0)",  # its script ends early: no timeout needed to tell
    "fails": "raise RuntimeError('out of data')",
    "hangs": "time.sleep(3600)",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_rank_that_hangs_or_leaves_is_named_last_within_seconds(tmp_path, fault):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(fault=FAULTS[fault])))
    argv = ["run", "--nproc", "2", "--hang-timeout", "4", str(script)]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    started = time.monotonic()
    result = run_cli(*argv, timeout=120, cwd=tmp_path, env={"TMPDIR": str(temporary)})
    took = time.monotonic() - started
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    if fault == "fails":  # the watchdog's verdict, or the agent's failure if it comes first
        assert last.startswith(("shardwise: hang: rank 1 ", "shardwise: worker rank 1 failed: "))
        assert "RuntimeError: out of data" in last, result.stderr[-3000:]
    else:
        assert last.startswith("shardwise: hang: rank 1 "), result.stderr[-3000:]
        assert "all_reduce #6 (group world" in last and "rank 0 waited" in last
        assert ("never arrived" if fault == "hangs" else "left the job") in last
    assert took < 40  # start-up, then the 4 s timeout at most: never the backend's 300 s
    assert sorted(tmp_path.iterdir()) == [script, temporary]  # (no report file lands here)
    # (torch's compiler stack, imported by the first optimizer, makes its cache folder in the
    # temporary folder: `torchinductor_USER`, unless a parent process's import named one)
    assert [p for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
