"""Hangs and desyncs named in seconds, with one report, on every rank of the job.

Each rank runs a watchdog thread. Every `INTERVAL` seconds it publishes a heartbeat in the
job's c10d store (its step, how many collectives it issued per group, its last call and the
call it waits in, from the flight recorder `comm.flight.recorder`). When this rank has waited
in one collective for `hang_timeout_s`, it asks every rank to publish its Python stack, reads
all heartbeats and writes the report: the ranks that never arrived at that collective, the
ones that issued a different call in its place (a desync), where each rank is, and the stacks.
Then every rank exits (code `EXIT_HUNG`), well before the backend's own timeout, which names
nobody. A rank that leaves the job (its script ended, or it failed: `runtime.announce_leaving`)
says so in the store with how many calls it issued; a rank waiting for it in a collective it
never reached is a hang at once, not after the timeout. The report's last line, and the verdict
the launcher prints last, name the rank that hung, not the one that reported it.

A desync that hangs is named within seconds, not after the timeout: once this rank has waited
in a collective for `SUSPECT_S`, it reads the heartbeats of the group's other ranks (again
every `SUSPECT_S`) and, when each of them waits in the same call number of the group and one
issued another call there (a broadcast where the others all-reduce, another shape), reports it
at once. A rank that is merely slow is not in that call yet: nothing is said until the timeout.

Desyncs that do not hang are caught by `check_sequences`: every K steps the ranks compare the
running hashes of their collectives through the store and, where they differ, name the first
differing call on each rank. `compare_each_call` (a debug mode) compares every call before it
is issued.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

from shardwise.comm.flight import P2P, UNWATCHED, Call, collective_groups, recorder
from shardwise.comm.store import wait_for
from shardwise.distributed import leaving, runtime

INTERVAL = 0.5  # seconds between heartbeats (and checks)
SUSPECT_S = 1.0  # a wait this long makes the watchdog compare the call with the group's
KEY = leaving.PREFIX  # heartbeats, stacks and the verdict beside the "left" records
EXIT_HUNG = 3  # exit code of every rank of a job the watchdog ended
STORE = "store"  # the "group" of a wait for other ranks' keys in the store
STORE_TIMEOUT_S = 24 * 3600.0  # such waits end by the watchdog's hang timeout, not their own


class DesyncError(RuntimeError):
    """Ranks issued different collectives; the message names the first differing calls."""


def _members(group: str, world_size: int) -> list[int] | None:
    """The global ranks of a group's name; None for point-to-point traffic and store waits."""
    if group == "world":
        return list(range(world_size))
    if group.replace(",", "").isdigit():
        return [int(r) for r in group.split(",")]
    return None


def name_ranks(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 2'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _call(data: dict | None) -> Call | None:
    return Call(**{**data, "shape": tuple(data["shape"])}) if data else None


def hang_report(
    call: Call,
    waited_s: float,
    beats: dict[int, dict],
    stacks: dict[int, str],
    world_size: int,
    left: dict[int, dict] | None = None,
) -> tuple[str, str]:
    """The report of a hang in `call` (this rank's view), from every rank's heartbeat and the
    records of the ranks that left; and its verdict: one line naming the rank that hung."""
    left = left or {}
    members = _members(call.group, world_size)
    if members is None:  # a message or a store wait: no group to compare; where everyone is
        head = f"shardwise: hang: {call.describe()} has not completed after {waited_s:.1f} s"
        lines = [head]
        for rank in range(world_size):
            lines.append(f"  rank {rank}: {_where(beats.get(rank), left.get(rank))}")
        for rank in sorted(stacks):
            lines.extend(_stack_lines(rank, stacks[rank]))
        return "\n".join(lines), head.removeprefix("shardwise: ")
    waiting, missing, other, lines = _sort_members(call, members, beats, left)
    body = [_head(call, waited_s, waiting, missing, other), *lines]
    for rank in sorted(stacks):  # the stacks of the ranks that are not where they should be
        if rank in missing or any(rank in r for r in other.values()):
            body.extend(_stack_lines(rank, stacks[rank]))
    return "\n".join(body), _verdict(call, waited_s, waiting, missing, other, left)


def _sort_members(
    call: Call, members: list[int], beats: dict[int, dict], left: dict[int, dict]
) -> tuple[list[int], list[int], dict[str, list[int]], list[str]]:
    """The group's ranks that wait in `call`; those that never arrived at it; those that
    issued another call in its place (by that call); and a line for each rank not in it."""
    waiting, missing, other, lines = [], [], {}, []
    for rank in members:
        beat = beats.get(rank)
        gone = left.get(rank)
        issued = (gone or beat or {}).get("seq", {}).get(call.group, 0)
        theirs = _call(beat.get("waiting")) if beat and not gone else None
        if theirs and theirs.group == call.group and theirs.seq == call.seq:
            if theirs.signature() == call.signature():
                waiting.append(rank)
            else:
                other.setdefault(theirs.describe(), []).append(rank)
        elif issued < call.seq:
            missing.append(rank)
            lines.append(f"  rank {rank} never arrived: {_where(beat, gone)}")
        else:
            lines.append(f"  rank {rank} went past it: {_where(beat, gone)}")
    return waiting, missing, other, lines


def _head(
    call: Call,
    waited_s: float,
    waiting: list[int],
    missing: list[int],
    other: dict[str, list[int]],
) -> str:
    """The report's first line: the desync or the hang, and the ranks that never arrived."""
    if other:  # the ranks issued different calls as the group's call number `seq`
        issued = {call.describe(): waiting, **other}
        head = (
            f"shardwise: desync: ranks issued different calls as call #{call.seq} of group "
            f"{call.group} (stuck {waited_s:.1f} s): "
            + "; ".join(
                f"{name_ranks(ranks)} issued {described}" for described, ranks in issued.items()
            )
        )
    else:
        verb = "waits" if len(waiting) == 1 else "wait"
        head = (
            f"shardwise: hang: {call.describe()} has not completed after {waited_s:.1f} s; "
            f"{name_ranks(waiting)} {verb} in it"
        )
    if missing:
        head += f"; {name_ranks(missing)} never arrived"
    return head


def _stack_lines(rank: int, stack: str) -> list[str]:
    """A rank's stack, indented under its name."""
    return [
        f"  rank {rank} stack (main thread):",
        *(f"    {line}" for line in stack.rstrip().splitlines()),
    ]


def _verdict(
    call: Call,
    waited_s: float,
    waiting: list[int],
    missing: list[int],
    other: dict[str, list[int]],
    left: dict[int, dict],
) -> str:
    """One line, the hung rank first: what the launcher prints last."""
    if other:
        named = "; ".join(f"{name_ranks(r)} issued {d}" for d, r in other.items())
        return f"desync: {named} where {name_ranks(waiting)} issued {call.describe()}"
    waited = f"{name_ranks(waiting)} waited {waited_s:.1f} s in it"
    if not missing:
        return f"hang: {call.describe()} never completed, every rank in it; {waited}"
    gone = [r for r in missing if r in left]
    stayed = [r for r in missing if r not in left]
    parts = []
    if stayed:
        parts.append(f"{name_ranks(stayed)} never arrived at {call.describe()}")
    for rank in gone:
        reason = left[rank].get("reason") or "its script ended"
        parts.append(f"rank {rank} left the job ({reason}) before {call.describe()}")
    return "hang: " + "; ".join(parts) + f"; {waited}"


def _where(beat: dict | None, gone: dict | None = None) -> str:
    if gone is not None:
        return f"left the job ({gone.get('reason') or 'its script ended'})"
    if beat is None:
        return "no heartbeat at all (never started, or died early)"
    age = time.time() - beat["time"]
    last = _call(beat.get("last"))
    waiting = _call(beat.get("waiting"))
    state = f"waits in {waiting.describe()}" if waiting else "not in a collective"
    alive = "alive" if age < 4 * INTERVAL else f"silent for {age:.1f} s (dead?)"
    last_text = last.describe() if last else "none"
    return f"step {beat['step']}, {alive}, {state}; last call {last_text}"


class Watchdog:
    """This rank's watchdog thread; `step` is set by the training loop."""

    def __init__(
        self, rank: int, world_size: int, timeout_s: float, report_dir: Path | None
    ) -> None:
        """`report_dir`: where `hang_report.txt` goes (None: stderr only, a user's script)."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.report_path = Path(report_dir) / "hang_report.txt" if report_dir else None
        self.store = runtime.store()
        self.step = 0
        self.checks = 0
        self.left: dict[int, dict] = {}  # ranks that left the job: their records
        self._compared: tuple[str, int, float] | None = None  # (group, call number, when)
        # An elastic job's membership (`distributed/membership.py`): a rank that hangs is
        # dropped from the job, which goes on, instead of ending it; None: the job ends.
        self.elastic = None
        self._reported = False  # (elastic: this rank reported a hang; once is enough)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            try:
                self._beat()
                if self.elastic is not None and self.elastic.gone(self.elastic.me):
                    self._leave_dropped()
                if self.store.check([f"{KEY}/abort"]):
                    self._join_abort()
                waited = recorder.longest_wait()
                if waited is not None and (
                    waited[1] > self.timeout_s
                    or self._left_before(waited[0])
                    or self._issued_another_call(*waited)
                ):
                    self._declare_hang(*waited)
            except Exception as e:  # the store is gone: the job is ending anyway
                if not self._stop.is_set():
                    print(f"shardwise: rank {self.rank}: watchdog stopped: {e}", file=sys.stderr)
                return

    def _beat(self) -> None:
        waited = recorder.longest_wait()
        last = recorder.last()
        beat = {
            "rank": self.rank,
            "time": time.time(),
            "step": self.step,
            "seq": collective_groups(dict(recorder.seq)),
            "last": last.to_json() if last else None,
            "waiting": waited[0].to_json() if waited else None,
        }
        self.store.set(f"{KEY}/beat/{self.rank}", json.dumps(beat))

    def _left_before(self, call: Call) -> bool:
        """Whether a member of `call`'s group left the job before issuing it (it never will)."""
        if leaving.count(self.store) > len(self.left):  # someone left since the last look: who
            for r in range(self.world_size):
                said = None if r in self.left else leaving.record(self.store, r)
                if said is not None:
                    self.left[r] = said
        members = _members(call.group, self.world_size) or []
        return any(
            self.left[r].get("seq", {}).get(call.group, 0) < call.seq
            for r in members
            if r in self.left and r != self.rank
        )

    def _issued_another_call(self, call: Call, waited_s: float) -> bool:
        """Whether every other rank of `call`'s group waits in the group's same call number and
        one of them issued a different call there: a desync, which will never complete."""
        members = _members(call.group, self.world_size)
        if waited_s < SUSPECT_S or not members:
            return False
        now = time.monotonic()
        last = self._compared
        if last and last[:2] == (call.group, call.seq) and now - last[2] < SUSPECT_S:
            return False  # (compared lately: the store is not read on every beat)
        self._compared = (call.group, call.seq, now)
        others = [f"{KEY}/beat/{r}" for r in members if r != self.rank]
        if not self.store.check(others):
            return False
        theirs = [_call(json.loads(self.store.get(k)).get("waiting")) for k in others]
        if any(t is None or (t.group, t.seq) != (call.group, call.seq) for t in theirs):
            return False  # someone is not in this call (yet): slow, or hung, not a desync
        return any(t.signature() != call.signature() for t in theirs)

    def _publish_stack(self) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no main thread)"
        self.store.set(f"{KEY}/stack/{self.rank}", stack)

    def _declare_hang(self, call: Call, waited_s: float) -> None:
        if self.elastic is not None:
            self._drop_the_hung(call, waited_s)
            return
        reporter = self.store.compare_set(f"{KEY}/reporter", "", str(self.rank)).decode()
        self.store.set(f"{KEY}/abort", "hang")
        if reporter != str(self.rank):  # another rank reports
            self._join_abort()
        try:
            self._report(call, waited_s)
        finally:  # whatever happened, the others are told and this rank goes
            with contextlib.suppress(Exception):
                self.store.set(f"{KEY}/done", "1")
            _exit_hung()

    def _report(self, call: Call, waited_s: float) -> None:
        self._publish_stack()
        deadline = time.monotonic() + 4 * INTERVAL
        stack_keys = [f"{KEY}/stack/{r}" for r in range(self.world_size)]
        while time.monotonic() < deadline and not self.store.check(stack_keys):
            if self.left and all(
                self.store.check([k]) for r, k in enumerate(stack_keys) if r not in self.left
            ):
                break  # (a rank that left publishes no stack)
            time.sleep(INTERVAL / 5)
        beats, stacks = self._beats(), {}
        for r in range(self.world_size):
            if self.store.check([stack_keys[r]]):
                stacks[r] = self.store.get(stack_keys[r]).decode()
        report, verdict = hang_report(call, waited_s, beats, stacks, self.world_size, self.left)
        self.store.set(f"{KEY}/verdict", verdict)  # what the launcher prints last
        where = ""
        if self.report_path is not None:
            with contextlib.suppress(OSError):
                self.report_path.parent.mkdir(parents=True, exist_ok=True)
                self.report_path.write_text(report + "\n")
                where = f" (report: {self.report_path})"
        print(f"{report}\nshardwise: {verdict}{where}", file=sys.stderr, flush=True)

    def _drop_the_hung(self, call: Call, waited_s: float) -> None:
        """Elastic: one rank reports the hang and drops the ranks that never arrived from the
        job's membership (the others then go on without them); a desync still ends the job."""
        if self._reported:
            return
        reporter = self.store.compare_set(f"{KEY}/reporter", "", str(self.rank)).decode()
        if reporter != str(self.rank):
            return  # (the reporter drops them; this rank's wait ends with the epoch)
        self._reported = True
        self.store.set(f"{KEY}/abort", "hang")
        self._report(call, waited_s)
        members = _members(call.group, self.world_size) or []
        _, missing, other, _ = _sort_members(call, members, self._beats(), self.left)
        if other or not missing:
            self.store.set(f"{KEY}/done", "1")
            _exit_hung()
        for rank in missing:
            self.elastic.drop(self.elastic.epoch.members[rank], f"hung in step {self.step}")

    def _beats(self) -> dict[int, dict]:
        return {
            r: json.loads(self.store.get(f"{KEY}/beat/{r}"))
            for r in range(self.world_size)
            if self.store.check([f"{KEY}/beat/{r}"])
        }

    def _leave_dropped(self) -> None:
        """Elastic: the job dropped this rank (it hung): it goes, and the job goes on."""
        why = self.elastic.gone(self.elastic.me)
        print(f"shardwise: rank {self.rank}: dropped from the job ({why})", file=sys.stderr)
        sys.stderr.flush()
        _exit_hung()

    def _join_abort(self) -> None:
        """Another rank declared a hang: give it this rank's stack, wait for its report, go
        (elastic: stay, unless this rank is the one dropped)."""
        self._publish_stack()
        if self.elastic is not None:
            return
        deadline = time.monotonic() + 10 * INTERVAL
        while time.monotonic() < deadline and not self.store.check([f"{KEY}/done"]):
            time.sleep(INTERVAL / 5)
        verdict = "the job hangs"
        with contextlib.suppress(Exception):
            if self.store.check([f"{KEY}/verdict"]):
                verdict = self.store.get(f"{KEY}/verdict").decode()
        print(f"shardwise: rank {self.rank}: ending: {verdict}", file=sys.stderr, flush=True)
        _exit_hung()

    # ---- desync checks (training thread) --------------------------------------------------------
    def check_sequences(self) -> None:
        """Collective through the store: every rank's sequence of calls compared; raises
        `DesyncError` naming the first differing call where they differ."""
        key = f"{KEY}/sequence/{self.checks}"
        self.checks += 1
        mine = {
            "seq": collective_groups(recorder.seq),
            "hash": collective_groups(recorder.hash),
            "history": [c.to_json() for c in recorder.history if c.group not in (P2P, UNWATCHED)],
        }
        self.store.set(f"{key}/{self.rank}", json.dumps(mine))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        check = Call("sequence_check", STORE, self.checks, (), "-", "watchdog.check_sequences")
        with recorder.blocked_in(check):  # a rank that never comes is a hang like any other
            wait_for(self.store, keys, STORE_TIMEOUT_S)
        everyone = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}
        groups = sorted({g for view in everyone.values() for g in view["seq"]})
        for group in groups:  # every rank checks every group: all raise, or none does
            members = _members(group, self.world_size) or []
            views = {r: everyone[r] for r in members}
            sums = {(v["seq"].get(group), v["hash"].get(group)) for v in views.values()}
            if len(sums) > 1:
                raise DesyncError(first_difference(group, views))

    def compare_each_call(self, call: Call, group) -> None:
        """Debug mode: every rank of the group compares `call` with theirs before issuing."""
        key = f"{KEY}/call/{call.group}/{call.seq}"
        self.store.set(f"{key}/{self.rank}", json.dumps(call.to_json()))
        members = _members(call.group, self.world_size) or [self.rank]
        waiting = Call("call_check", STORE, call.seq, (), "-", "watchdog.compare_each_call")
        with recorder.blocked_in(waiting):
            wait_for(self.store, [f"{key}/{r}" for r in members], STORE_TIMEOUT_S)
        for r in members:
            theirs = _call(json.loads(self.store.get(f"{key}/{r}")))
            if theirs.signature() != call.signature():
                raise DesyncError(
                    f"shardwise: desync: rank {self.rank} issued {call.describe()} where "
                    f"rank {r} issued {theirs.describe()}"
                )


def first_difference(group: str, views: dict[int, dict]) -> str:
    """The first call of `group` whose signature differs between ranks, named on each."""
    calls = {
        r: {c["seq"]: _call(c) for c in v["history"] if c["group"] == group}
        for r, v in views.items()
    }
    common = set.intersection(*(set(c) for c in calls.values()))
    for seq in sorted(common):
        signatures = {r: c[seq].signature() for r, c in calls.items()}
        if len(set(signatures.values())) > 1:
            described = "; ".join(f"rank {r} issued {c[seq].describe()}" for r, c in calls.items())
            return f"shardwise: desync in group {group}: {described}"
    counts = ", ".join(f"rank {r}: {v['seq'].get(group, 0)}" for r, v in views.items())
    return (
        f"shardwise: desync in group {group}: the ranks issued different numbers or kinds of "
        f"calls ({counts} calls), before the last ones they remember"
    )


def _exit_hung() -> NoReturn:
    """Leave now (a graceful end would wait on the hung collective), what was printed out."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_HUNG)
