"""An emulated multi-host cluster on one machine: network namespaces, veth links, capped bandwidth.

Each host is a network namespace with one interface (`eth0`, 10.77.<id>.<host+1>/24) plugged into
a bridge that lives in a "switch" namespace of its own, so nothing touches the machine's own
network. `tc qdisc ... tbf` caps every host's egress (netem is not available here). One torchrun
agent runs per host: a real multi-node c10d rendezvous over the emulated links. Everything is
removed on exit, on failure and on Ctrl-C (deleting a namespace deletes its links).

    python -m shardwise.distributed.emulated_cluster --hosts 2 --rate 100mbit -- train digits
    # runs `python -m shardwise train digits` on 2 hosts, one rank each

Needs root (or CAP_NET_ADMIN) and iproute2; `available()` says whether this machine allows it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

PREFIX = "sw"  # every namespace we create starts with this and our run id


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def available() -> bool:
    """True when network namespaces can be created here."""
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError):
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


def our_namespaces(run_id: str = "") -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}{run_id}")]


@dataclass
class Cluster:
    hosts: int
    rate: str = "100mbit"
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    subnet: int = 77

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run_id}sw"

    def host(self, i: int) -> str:
        return f"{PREFIX}{self.run_id}h{i}"

    def address(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i in range(self.hosts):
            ns, port = self.host(i), f"p{i}"
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", netns=ns)
            # A veth pair created inside the host, its peer moved into the switch.
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", port, netns=ns)
            _ip("link", "set", port, "netns", self.switch, netns=ns)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    self.rate,
                    "burst",
                    "256kbit",
                    "latency",
                    "400ms",
                ],
                check=True,
                capture_output=True,
            )

    def down(self) -> None:
        for ns in our_namespaces(self.run_id):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def agent_command(
        self, i: int, port: int, args: list[str], module: str, logs: str
    ) -> list[str]:
        """torchrun on host i, one rank, rendezvous at host 0; its agent logs under `logs`."""
        conf = ["--rdzv-conf", "is_host=1"] if i == 0 else []
        return [
            "ip",
            "netns",
            "exec",
            self.host(i),
            "env",
            "GLOO_SOCKET_IFNAME=eth0",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--log-dir",
            logs,
            "--nnodes",
            str(self.hosts),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.address(0)}:{port}",
            "--rdzv-id",
            self.run_id,
            *conf,
            # Inside a namespace the hostname resolves to loopback: name the real address.
            "--local-addr",
            self.address(i),
            "-m",
            module,
            *args,
        ]

    def run(
        self, args: list[str], port: int = 29400, timeout: float = 600, module: str = "shardwise"
    ) -> list[int]:
        """Run `python -m MODULE ARGS` on every host; return each agent's exit code."""
        # (torchrun's agents otherwise leave a log directory of their own in /tmp per run)
        with tempfile.TemporaryDirectory(prefix="shardwise-cluster-") as logs:
            agents = [
                subprocess.Popen(self.agent_command(i, port, args, module, logs))
                for i in range(self.hosts)
            ]
            try:
                return [agent.wait(timeout=timeout) for agent in agents]
            finally:
                for agent in agents:
                    if agent.poll() is None:
                        agent.kill()
                        agent.wait()


@contextlib.contextmanager
def emulated(hosts: int, rate: str = "100mbit") -> Iterator[Cluster]:
    """The cluster, built and always torn down."""
    cluster = Cluster(hosts, rate)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate per host, e.g. 1gbit")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- shardwise arguments")
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) must unwind through the `finally` that removes the hosts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = [a for a in args.args if a != "--"] or ["train"]
    if not available():
        print("shardwise: cannot create network namespaces here (needs root)", file=sys.stderr)
        return 2
    with emulated(args.hosts, args.rate) as cluster:
        codes = cluster.run(command)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
