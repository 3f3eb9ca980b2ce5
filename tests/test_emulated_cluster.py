"""The emulated multi-host network: real multi-node rendezvous, capped links, no leftovers."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from shardwise.distributed.emulated_cluster import available, emulated, our_namespaces

pytestmark = pytest.mark.skipif(
    not available(), reason="network namespaces cannot be created here (needs root/iproute2)"
)


def _agent_logs() -> set[str]:
    """torchrun's agents' log directories in the temporary directory (its default place)."""
    prefixes = ("torchelastic_", "shardwise-cluster-")
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefixes)}


def test_two_hosts_train_over_a_capped_link_and_leave_nothing_behind(tmp_path):
    logs_before = _agent_logs()
    with emulated(hosts=2, rate="100mbit") as cluster:
        run_id = cluster.run_id
        assert len(our_namespaces(run_id)) == 3  # two hosts and the switch
        qdisc = subprocess.run(
            ["ip", "netns", "exec", cluster.host(0), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        args = [
            "train",
            "digits",
            "--set",
            "train.steps=10",
            "--set",
            "train.measure=false",
            "--set",
            f"launch.runs_dir={tmp_path}",
        ]
        assert cluster.run(args, timeout=180) == [0, 0]
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert our_namespaces(run_id) == []
    assert _agent_logs() == logs_before  # (the agents' logs went with the run)


def test_a_failing_job_still_removes_the_hosts():
    with pytest.raises(RuntimeError), emulated(hosts=2) as cluster:
        run_id = cluster.run_id
        codes = cluster.run(["train", "--set", "data.path=missing.txt"], timeout=120)
        assert codes == [1, 1]  # each agent reports its worker's config error as a failure
        raise RuntimeError("the job failed")
    assert our_namespaces(run_id) == []
