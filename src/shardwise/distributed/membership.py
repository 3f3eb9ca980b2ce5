"""Who is in the job now: the membership of an elastic job (`train.on_failure: shrink`), agreed
through the job's store, epoch after epoch.

Epoch 0 is the ranks the job started with. A rank that finds a collective broken (a peer died,
or the watchdog dropped one that hung) reports the epoch failed; every other member's blocked
wait sees that within `collectives.POLL_S` and reports too, each with the newest step whose
state it holds (`committed`). Once every member of the epoch has either reported or is known
gone (the launcher saw it exit; the watchdog dropped it; or it stayed silent for `settle_s`),
the first to propose the next epoch's members wins (`compare_set`): the reporters, with the step
to go on from, the smallest committed one. Joiners come in the same way, at a step boundary.

Members are named by id: the rank they were started as ("3"), with the number of the start
after the first for a replacement ("3#1"). Keys, below the store's (attempt) prefix:

    elastic/gone/{id}              why a member is gone for good (launcher, watchdog)
    elastic/{epoch}/failed         why the epoch ended (the first reporter's reason)
    elastic/{epoch}/alive/{id}     a member's report: the newest step it holds the state of
    elastic/{epoch}/members        the epoch's decision (JSON: members, step, left, joined)
    elastic/latest                 the newest decided epoch
    elastic/joins, elastic/join/N  joiners, in the order they asked
    elastic/closed                 the job's work is done: joiners still waiting leave
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

PREFIX = "elastic"
ID_ENV = "SHARDWISE_MEMBER_ID"  # set by the launcher on a replacement ("3#1")
SETTLE_POLL_S = 0.02


class Dropped(RuntimeError):
    """This process is not in the job's next epoch: the others went on without it."""


def my_id(rank: int) -> str:
    return os.environ.get(ID_ENV, str(rank))


def is_replacement() -> bool:
    """Whether this process was started to replace a lost one (it joins a running job)."""
    return "#" in os.environ.get(ID_ENV, "")


@dataclass
class Epoch:
    """One agreed membership: its number, members in rank order, and the step it starts at
    (the step whose state every member holds or is sent; 0: the job's start)."""

    number: int
    members: list[str]
    step: int = 0
    left: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    why: str = ""
    passed_over: list[str] = field(default_factory=list)  # joiners that died before it

    @property
    def joins(self) -> int:
        """The requests to join it answered: those taken in and those passed over."""
        return len(self.joined) + len(self.passed_over)

    def rank_of(self, member: str) -> int:
        return self.members.index(member)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes) -> Epoch:
        data = json.loads(raw)
        return cls(
            int(data["number"]),
            [str(m) for m in data["members"]],
            int(data["step"]),
            [str(m) for m in data.get("left", [])],
            [str(m) for m in data.get("joined", [])],
            str(data.get("why", "")),
            [str(m) for m in data.get("passed_over", [])],
        )


def first_epoch(world_size: int) -> Epoch:
    return Epoch(0, [str(r) for r in range(world_size)])


def _key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def _get(store: dist.Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


class Membership:
    """This process's view of the job's membership, and the store protocol that changes it."""

    def __init__(self, store: dist.Store, me: str, epoch: Epoch, settle_s: float) -> None:
        self.store, self.me, self.epoch, self.settle_s = store, me, epoch, settle_s
        self.admitted_joins = 0  # joiners taken in so far (`elastic/joins` counts requests)

    # ---- failure ------------------------------------------------------------------------
    def failed(self) -> str | None:
        """Why the present epoch ended, if a member said so (what a blocked wait asks)."""
        raw = _get(self.store, _key(self.epoch.number, "failed"))
        return None if raw is None else raw.decode(errors="replace")

    def report_failure(self, reason: str) -> None:
        self.store.compare_set(_key(self.epoch.number, "failed"), "", reason)

    def drop(self, member: str, reason: str) -> None:
        """`member` is out of the job for good (it hung); its epoch has failed."""
        self.store.set(_key("gone", member), reason)
        self.report_failure(f"{member_name(member)} {reason}")

    def gone(self, member: str) -> str | None:
        raw = _get(self.store, _key("gone", member))
        return None if raw is None else raw.decode(errors="replace")

    def agree_after_failure(self, committed: int) -> Epoch:
        """Report this member alive, holding the state of step `committed`; wait until every
        member has reported or is gone, and return the next epoch. `Dropped` if it goes on
        without this process (it was too late)."""
        number = self.epoch.number
        self.report_failure(f"{member_name(self.me)} lost a peer")
        self.store.set(_key(number, "alive", self.me), json.dumps({"step": committed}))
        steps: dict[str, int] = {}
        left: dict[str, str] = {}
        started = time.monotonic()
        decided = None
        while decided is None:
            for member in self.epoch.members:
                if member in steps or member in left:
                    continue
                raw = _get(self.store, _key(number, "alive", member))
                if raw is not None:
                    steps[member] = int(json.loads(raw)["step"])
                elif (why := self.gone(member)) is not None:
                    left[member] = why
                elif time.monotonic() - started > self.settle_s:
                    left[member] = f"did not answer within {self.settle_s:.0f} s"
            decided = _get(self.store, _key(number + 1, "members"))
            if decided is None and len(steps) + len(left) == len(self.epoch.members):
                reason = (_get(self.store, _key(number, "failed")) or b"").decode(errors="replace")
                proposal = Epoch(
                    number + 1,
                    [m for m in self.epoch.members if m in steps],
                    min(steps.values()),
                    left=[m for m in self.epoch.members if m in left],
                    why="; ".join(f"{member_name(m)} {left[m]}" for m in sorted(left)) or reason,
                )
                decided = self.store.compare_set(
                    _key(number + 1, "members"), "", proposal.to_json()
                )
            elif decided is None:
                time.sleep(SETTLE_POLL_S)
        return self._enter(Epoch.from_json(decided))

    # ---- joining ----------------------------------------------------------------------
    def ask_to_join(self) -> None:
        """A replacement asks to be taken in at the members' next step boundary."""
        n = self.store.add(_key("joins"), 1)
        self.store.set(_key("join", n), self.me)

    def joiners_waiting(self) -> int:
        """How many replacements wait to be taken in (what rank 0 asks each step)."""
        return int(self.store.add(_key("joins"), 0)) - self.admitted_joins

    def admit(self, step: int) -> Epoch:
        """As `step` begins, every member takes the waiting joiners in: the next epoch starts
        there, its new members last. (Every member calls this at the same step; the first
        proposal wins: a joiner that asked meanwhile waits for the next.)"""
        total = int(self.store.add(_key("joins"), 0))
        asked = []
        for n in range(self.admitted_joins + 1, total + 1):
            name = _get(self.store, _key("join", n))
            if name is None:  # (counted, its name not set yet: it waits for the next)
                break
            asked.append(name.decode())
        # A joiner that died after asking is passed over (its rendezvous would wait for it),
        # but counted as taken in: its number is not asked about again.
        joiners = [j for j in asked if self.gone(j) is None]
        dead = [j for j in asked if j not in joiners]
        why = [f"{', '.join(map(member_name, joiners))} joined"] if joiners else []
        why += [f"{member_name(j)} died before it was taken in" for j in dead]
        proposal = Epoch(
            self.epoch.number + 1,
            [*self.epoch.members, *joiners],
            step,
            joined=joiners,
            why="; ".join(why),
            passed_over=dead,
        )
        decided = self.store.compare_set(
            _key(self.epoch.number + 1, "members"), "", proposal.to_json()
        )
        return self._enter(Epoch.from_json(decided))

    def close(self) -> None:
        """The job's work is done (rank 0 says so): joiners still waiting leave."""
        self.store.set(_key("closed"), "1")

    def wait_to_be_admitted(self, poll_s: float = 0.05) -> Epoch | None:
        """A joiner: the epoch that takes it in (None: the job ended first)."""
        while not self.store.check([_key("closed")]):
            latest = _get(self.store, _key("latest"))
            if latest is not None:
                raw = _get(self.store, _key(int(latest), "members"))
                epoch = Epoch.from_json(raw)
                if self.me in epoch.joined:
                    self.epoch = epoch
                    self.admitted_joins = self._joins_in(epoch.number)
                    return epoch
            time.sleep(poll_s)
        return None

    def previous(self, epoch: Epoch, first_world: int) -> Epoch:
        """The epoch before `epoch` (the job's first has `first_world` ranks)."""
        if epoch.number == 1:
            return first_epoch(first_world)
        return Epoch.from_json(self.store.get(_key(epoch.number - 1, "members")))

    def _joins_in(self, number: int) -> int:
        """Joiners taken in up to epoch `number` (every member counts alike)."""
        total = 0
        for n in range(1, number + 1):
            total += Epoch.from_json(self.store.get(_key(n, "members"))).joins
        return total

    def _enter(self, epoch: Epoch) -> Epoch:
        if self.me not in epoch.members:
            raise Dropped(
                f"{member_name(self.me)} was left out of the job's epoch {epoch.number} "
                f"({epoch.why})"
            )
        self.store.set(_key("latest"), str(epoch.number))
        self.admitted_joins += epoch.joins
        self.epoch = epoch
        return epoch


def member_name(member: str) -> str:
    """'rank 3', or 'rank 3 (start 2)' for a replacement."""
    slot, _, start = member.partition("#")
    return f"rank {slot}" + (f" (start {int(start) + 1})" if start else "")


def gone_key(member: str) -> str:
    """The key the launcher sets when `member`'s process exits."""
    return _key("gone", member)
