"""How one rank of a training job ends when it does not finish: asked to stop by a signal, or
failed on its own. Every rank of a job ends the same way, with an exit code that says how."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import NoReturn

from safetensors import SafetensorError

from shardwise.arguments import our_refusal
from shardwise.comm.broken import PHRASES
from shardwise.comm.interrupt import PeerLost
from shardwise.comm.shared_memory import PeerProcessEnded
from shardwise.distributed import runtime
from shardwise.distributed.leaving import EndedBeforeJoining, failed_ranks
from shardwise.faults.watchdog import name_ranks


def signal_exit_code(stopped_by: dict[int, int]) -> int:
    """Every rank leaves with 128 + the signal of the lowest rank that was sent one."""
    return 128 + stopped_by[min(stopped_by)]


def stop_message(stopped_by: dict[int, int], step: int, steps: int, how: str, run_dir) -> str:
    """Rank 0's line after the step every rank agreed to stop at: who was sent which signal,
    and how to go on."""
    who = name_ranks(sorted(stopped_by))
    names = "/".join(sorted({_signal_name(n) for n in stopped_by.values()}))
    return (
        f"shardwise: {who} got {names}: stopped after step {step} of {steps} {how}; "
        f"go on with: shardwise train --resume {run_dir}"
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def leave(error: Exception) -> NoReturn:
    """This rank failed on its own: one line for an expected error (a file of the run that
    cannot be written, a checkpoint that does not fit), the traceback for anything else; the
    other ranks are told (`runtime.announce_leaving`), and the process exits now. A graceful
    teardown cannot finish: its barrier never completes while the others wait for this rank in
    a collective, and the process, its barrier pending, did not exit until their watchdog
    ended them (71 s on a full disk)."""
    rank = os.environ.get("RANK", "0")
    # Expected: a file of the run that cannot be written or read (OSError, SafetensorError), a
    # checkpoint or config that does not fit (ValueError: RunCheckpointError, ConfigError), our
    # own refusals; a ValueError raised in the user's code or torch's keeps its traceback.
    if isinstance(error, (OSError, SafetensorError)) or our_refusal(error):
        reason = " ".join(str(error).split())
        print(f"shardwise: rank {rank}: {reason}", file=sys.stderr, flush=True)
    elif gone := _ranks_that_left(int(rank)):  # a collective broken by their exit: no bug here
        reason = f"{name_ranks(gone)} left the job"
        print(f"shardwise: rank {rank}: {reason}: stopping", file=sys.stderr, flush=True)
    elif lost := _peer_lost(error):  # (one killed says nothing: the launcher names it)
        reason = lost
        print(f"shardwise: rank {rank}: {reason}: stopping", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
    runtime.announce_leaving(reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if our_refusal(error) else 1)  # (2: what was given; 1: a failure, a bug's)


def _peer_lost(error: Exception) -> str | None:
    """A few words where `error` is this rank losing a peer (its process ended, its connection
    broke, the membership moved on), not a failure of its own; else None."""
    if isinstance(error, PeerProcessEnded):
        return f"{name_ranks(error.ranks)} ended"
    if isinstance(error, (PeerLost, EndedBeforeJoining)):
        return str(error).splitlines()[0] if str(error) else "a peer was lost"
    if phrase := next((p for p in PHRASES if p in str(error)), None):
        # (the phrase as gloo writes it: the launcher tells a victim from a culprit by it)
        return f"a connection to another rank broke ({phrase})"
    return None


def _ranks_that_left(rank: int) -> list[int]:
    """The other ranks that announced they left the job on a failure (`announce_leaving`)."""
    try:
        return failed_ranks(runtime.store(), runtime.current().world_size, but=rank)
    except Exception:  # no job to ask (it failed before joining), or its store is gone
        return []
