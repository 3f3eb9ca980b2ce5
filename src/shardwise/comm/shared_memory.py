"""All-reduce through shared memory, for the ranks of one host.

Where every rank of a group computes on one host's CPU, gloo's messages are copies through the
kernel's loopback sockets, made by the cores that compute: on 2 cores, gloo's all-reduce of
23 MB of fp32 took 18.5 ms, and the same sum made in place through shared memory 4 ms. Here each
buffer lives in a shared-memory file that every rank of the group maps, cut into blocks
(`SUM_BLOCK_BYTES`), and an all-reduce is

1. each rank stamps each block of its own buffer once the block holds its whole contribution
   (`Progress`): all of them when it starts the all-reduce, or earlier, block by block, as its
   strategy says they are written (`written`: DDP, as each gradient lands in its bucket);
2. each rank claims blocks that every rank has stamped, a few at a time, until none is left;
   for each it adds every rank's block, in rank order, into rank 0's (and divides the sum by the
   group's size there, for `start_mean`: DDP's equal shares then need no pass of their own over
   the gradients), then copies the sum over every other rank's block; the claim makes the
   block, in every buffer, its alone to read and write.
   Each block's passes run while it is in cache. A rank that finished its backward first sums
   the gradients its peers made already while they compute the rest: on the bench MLP, the
   slowest rank's own part of the all-reduce fell from 2.6 ms where both ranks started
   together to 0.6-0.8 ms where it started 3 ms after the other;
3. (barrier) every buffer holds the whole sum, and no rank touches another's buffer until the
   next all-reduce (the next gradients are written into a rank's own only).

The ranks read and write about twice their buffers between them, whatever the group's size
(the rank that claims more blocks doing more of it); no byte crosses a socket. The barriers
are counters in shared memory too (`Arrivals`): gloo's barrier took
0.4-1.5 ms after a step's compute, for what a counter tells in microseconds. A wait that outlasts
the group's timeout, or the job's membership (`interrupt`), fails instead of hanging. A file is
unlinked as soon as every rank has mapped it: none outlives the job, however it ends. Only sums
of plain numbers cross between processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardwise.comm import interrupt
from shardwise.comm.accounting import native_volume
from shardwise.comm.all_reduce_base import ThreadedAllReduce
from shardwise.comm.collectives import Handle, _issue, all_reduce
from shardwise.comm.direct import torch_all_gather_flat
from shardwise.comm.mean import divide_

CPU = torch.device("cpu")
SHARED_MEMORY = Path("/dev/shm")  # (Linux's memory-backed file system)
LINE = 64  # bytes: a counter's file (a page apart from the others': no contention)
# A waiter yields its core once, then sleeps between polls, from FIRST_PAUSE_S doubling up to
# PAUSE_S. Polling at full speed for the first millisecond instead cost the bench GPT's step
# 2.4-4.1 ms in DDP and 0.9-4.2 in ZeRO-3 (three A/B runs each, 30-60 interleaved steps; the
# MLP's: no difference): its rank's core went to polling while the other rank computed.
FIRST_PAUSE_S, PAUSE_S = 5e-5, 0.001
# A rank that waits on its own thread for blocks its peers have yet to write (`_claim`) polls
# at least this often: its core has nothing else to do, and a peer that finds nothing left to
# claim waits for it to arrive. On the communication thread it pauses as an arrival does,
# leaving the core to the training thread's backward.
WRITTEN_PAUSE_S = 1e-4
CHECK_S = 0.05  # and every this long asks whether a missing peer's process ended
MEAN_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# A block, stamped, claimed, summed, divided and handed on whole, each of its passes while it
# is in the core's cache: in a pass of their own, the division and the copy to the peers read
# the whole buffer again from memory. In DDP's step, 2 ranks on 2 cores (100 steps, medians,
# each rank summing a fixed half then): the MLP's 11.6 MB half took 3.7-4.0 ms whole, 2.9-3.2
# ms by 256 KiB (128 KiB 3.2, 64 KiB 3.7: the calls add up; 1 MiB 3.6-3.8: past the cache);
# the GPT's 6.5 MB 2.3-2.5 ms whole, 1.8-1.9 ms by 256 KiB.
SUM_BLOCK_BYTES = 2**18


class PeerProcessEnded(RuntimeError):
    """The process of a peer this rank waited for in a meeting ended (killed, or failed)."""

    def __init__(self, what: str, ranks: list[int]) -> None:
        super().__init__(f"{what}: the process of rank(s) {ranks} ended")
        self.ranks = ranks


def process_ended(pid: int) -> bool:
    """Whether process `pid` (of this host) has ended: gone, or a zombie not yet reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"  # (the state follows the command's parenthesis)


# What a rank arrives for, marked beside its counter (`Arrivals.wait`): a call's kind in the top
# bits, then the buffer it reduces from and the part it holds (a reduce-scatter), or the part
# it exchanges next another way (a meeting before it). Any other arrival is marked 0.
REDUCE_SCATTER, EXCHANGE = 1, 2
KEY_BITS, BUFFER_BITS = 32, 28


def mark(kind: int, key: int = 0, buffer: int = 0) -> int:
    if not (0 <= key < 1 << KEY_BITS and 0 <= buffer < 1 << BUFFER_BITS):
        raise ValueError(
            f"a part's key must be in [0, 2^{KEY_BITS}) and a buffer's number in "
            f"[0, 2^{BUFFER_BITS}): key {key}, buffer {buffer}"
        )
    return kind << (KEY_BITS + BUFFER_BITS) | buffer << KEY_BITS | key


def arrived_for(marked: int) -> str:
    """What a mark says, in words."""
    kind, key = marked >> (KEY_BITS + BUFFER_BITS), marked & ((1 << KEY_BITS) - 1)
    buffer = (marked >> KEY_BITS) & ((1 << BUFFER_BITS) - 1)
    if kind == REDUCE_SCATTER:
        return f"the reduce-scatter of part {key} from buffer {buffer}"
    if kind == EXCHANGE:
        return f"the exchange of part {key} through the process group"
    return "another collective"


class Arrivals:
    """A barrier among processes that each map every rank's counter (one int64 in a file of
    its own): an arrival raises this rank's counter, then waits until every counter is as high.
    Each arrival is marked with what it is for, and every rank reads every rank's mark once all
    arrived: ranks that came for different calls are refused on every rank, where they would
    have summed each other's unrelated buffers, or waited on each other until the timeout.

    x86-64 keeps a process's stores in order, and its loads: a peer that reads this rank's new
    count also reads what this rank wrote before it (`supported` allows no other machine).
    A waiter sleeps between polls, 50 us at first, doubling up to 1 ms: ranks that outnumber
    the cores do not take them from the ranks still computing. A peer whose
    process ended fails the wait within `CHECK_S`, as a closed connection fails gloo's."""

    def __init__(
        self,
        counters: list[np.ndarray],
        rank: int,
        pids: list[int],
        timeout_s: float,
        what: str,
    ) -> None:
        self.counters, self.mine, self.timeout_s = counters, counters[rank], timeout_s
        self.what = what  # (the collective, as its errors name it)
        self.peers = {k: pid for k, pid in enumerate(pids) if k != rank}
        self.arrivals = 0

    def wait(self, what: str | None = None, marked: int = 0) -> None:
        """`what`: the collective this arrival is for, as its errors name it (default: the
        one given when made); `marked`: what for (`mark`), every rank's checked against it.

        The marks of arrival n lie in word 1 + n % 2 of each counter's line, written before the
        count: a rank writes arrival n + 2's only once every rank has arrived at n + 1, after
        reading n's marks. (Not where a wait failed, a peer's process ended or the timeout
        passed: the group is done with then, and a peer may read a later mark than the one it
        waited for, and say so instead of what failed.)"""
        self.arrivals += 1
        n, counters, word = self.arrivals, self.counters, 1 + self.arrivals % 2
        self.mine[word] = marked
        self.mine[0] = n
        if any(c[0] < n for c in counters):
            self.until(lambda: [k for k, c in enumerate(counters) if c[0] < n], what)
        if any(c[word] != marked for c in counters):
            others = {k: int(c[word]) for k, c in enumerate(counters) if c[word] != marked}
            theirs = "; ".join(f"rank {k} for {arrived_for(m)}" for k, m in others.items())
            raise RuntimeError(
                f"{what or self.what}: ranks arrived for different calls: this rank for "
                f"{arrived_for(marked)}; {theirs} (every rank must run the model's parts in "
                "the same order)"
            )

    def until(
        self, missing: Callable[[], list[int]], what: str | None = None, longest: float = PAUSE_S
    ) -> None:
        """Wait until `missing()` (the ranks yet to write something into shared memory) is
        empty, failing as `wait` does where one of them cannot write it any more. `longest`:
        the longest pause between polls."""
        start = time.perf_counter()
        since, checked, pause = interrupt.membership(), start, 0.0
        while late := missing():
            time.sleep(pause)  # (0: a yield of the core, and of the GIL)
            pause = min(longest, max(2 * pause, FIRST_PAUSE_S))
            now = time.perf_counter()
            if now - checked > CHECK_S:
                checked = now
                self._check(late, since, now - start, what or self.what)

    def _check(self, late: list[int], since: int, waited_s: float, what: str) -> None:
        ended = [k for k in late if k in self.peers and process_ended(self.peers[k])]
        if ended:
            raise PeerProcessEnded(what, ended)
        interrupt.raise_if_interrupted(since)
        if waited_s > self.timeout_s:
            raise RuntimeError(
                f"{what}: rank(s) {late} did not arrive within {self.timeout_s:.0f} s"
            )


class Progress:
    """Which blocks of a placed buffer (`SUM_BLOCK_BYTES` each) every rank has written for the
    buffer's next all-reduce, and which blocks the ranks have claimed to sum.

    Each rank stamps a block of its own buffer with the number of that all-reduce once the
    block holds its whole contribution: as its strategy tells (`written`: DDP as each gradient
    lands in its bucket), else all at once when the all-reduce begins. A block is summed by
    whichever rank claims it first, once every rank has stamped it, so a rank that finished
    its backward early sums the gradients its peers made already while they compute the rest
    (the blocks are claimed in the buffer's order, which DDP's buckets make backward's).
    The blocks' claims are counted in rank 0's file, under a lock (`flock`) every rank holds
    for one read and write of the count: x86-64 has no atomic increment from Python. The lock
    keeps other processes out, not this rank's other threads: a rank runs its all-reduces one
    at a time (its communication thread in order, and `start_last` after it)."""

    def __init__(
        self, tails: list[np.ndarray], rank: int, numel: int, block: int, number: int = 0
    ) -> None:
        self.number = number  # the buffer's, in the order the ranks made them (its marks')
        self.block, self.blocks = block, -(-numel // block)
        self.stamps = [t[: 8 * self.blocks].view(np.int64) for t in tails]
        self.mine = self.stamps[rank]
        self.claims = tails[0][8 * self.blocks : 8 * self.blocks + 8].view(np.int64)
        self.sizes = [block] * (self.blocks - 1) + [numel - block * (self.blocks - 1)]
        # Of this rank's blocks, the elements not yet written for the next all-reduce: Python's
        # numbers, not an array's (`written` runs in every gradient's hook: a numpy element's
        # read and write cost 0.7-0.9 ms of the bench GPT's DDP step in 53 hooks)
        self.remaining = list(self.sizes)
        self.begun = 0  # all-reduces of the buffer begun

    @staticmethod
    def tail_bytes(numel: int, block: int) -> int:
        return 8 * (-(-numel // block) + 1)

    def written(self, start: int, stop: int) -> None:
        """Elements [start, stop) of this rank's buffer hold their part of the next all-reduce;
        no write before that all-reduce changes them."""
        if stop <= start:
            return
        block, remaining = self.block, self.remaining
        first, last, nxt = start // block, (stop - 1) // block, self.begun + 1
        if last > first + 1:  # (the blocks in between, whole, and none of them written before)
            if remaining[first + 1 : last] != self.sizes[first + 1 : last]:
                raise RuntimeError(
                    f"shared-memory all-reduce: elements {start}-{stop} written twice before "
                    "their all-reduce"
                )
            remaining[first + 1 : last] = [0] * (last - first - 1)
            self.mine[first + 1 : last] = nxt
        for b in (first,) if first == last else (first, last):
            remaining[b] -= min(stop, (b + 1) * block) - max(start, b * block)
            if remaining[b] == 0:
                self.mine[b] = nxt
            elif remaining[b] < 0:  # (a peer may have summed what it holds already)
                raise RuntimeError(
                    f"shared-memory all-reduce: elements {start}-{stop} written twice before "
                    "their all-reduce"
                )

    def forget(self) -> None:
        """Nothing is written for the next all-reduce after all (`forget_written`)."""
        self.mine[:] = self.begun
        self.remaining = list(self.sizes)

    def begin(self) -> int:
        """This rank's whole buffer is written: the number of the all-reduce now begun."""
        self.begun += 1
        self.mine[:] = self.begun
        self.remaining = list(self.sizes)
        return self.begun

    def ready_run(self, b: int, most: int, n: int) -> int:
        """How many blocks from `b` on (up to `most`) every rank has stamped for all-reduce `n`."""
        lowest = self.stamps[0][b : b + most]
        for stamps in self.stamps[1:]:
            lowest = np.minimum(lowest, stamps[b : b + most])
        behind = lowest < n
        return int(behind.argmax()) if behind.any() else len(lowest)

    def unwritten(self, b: int, n: int) -> list[int]:
        """The ranks yet to stamp block `b` for all-reduce `n`."""
        return [k for k, s in enumerate(self.stamps) if s[b] < n]


def supported() -> bool:
    """Whether this host can sum through shared memory: Linux's /dev/shm on x86-64 (whose
    memory order `Arrivals` relies on)."""
    return SHARED_MEMORY.is_dir() and os.uname().machine in ("x86_64", "AMD64")


def _create(path: Path, nbytes: int) -> bool:
    """A new file of `nbytes` whose pages are reserved now (a full /dev/shm fails here, not
    with SIGBUS at the first write into the mapping); False where it cannot be made."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def _unlinked_on_failure(path: Path | None) -> Iterator[None]:
    """Where what follows this rank's making of `path` fails (a peer lost while the ranks meet,
    a mapping refused), the file goes: nothing else would unlink it, and /dev/shm is memory
    until the machine restarts."""
    try:
        yield
    except BaseException:
        if path is not None:
            path.unlink(missing_ok=True)
        raise


class SharedMemoryAllReduce(ThreadedAllReduce):
    """Sums buffers it placed itself (`new_buffer`) through shared memory, on its thread; any
    other buffer (or all of them, where shared memory cannot be had) with gloo's all-reduce
    over the same group. Collective: every rank of the world creates it together, and makes
    the same buffers in the same order."""

    op = "all_reduce"

    def __init__(self, timeout: timedelta | None = None) -> None:
        super().__init__()
        self.group = dist.new_group(timeout=timeout)
        self.rank, self.size = self.group.rank(), self.group.size()
        token = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0])
        dist.broadcast(token, group_src=0, group=self.group)
        self._prefix = f"shardwise-{int(token):x}-"
        self._made = 0
        # Every rank's mapping of each shared buffer but this rank's own (None), by the address
        # of this rank's: dropped with it (a finalizer), since a rebucketed model makes new ones.
        self._peers: dict[int, list[np.ndarray | None]] = {}
        self._progress: dict[int, Progress] = {}  # (by the same address)
        self.arrivals: Arrivals | None = None
        counters = self._map_shared("arrivals", LINE)
        if counters is not None:
            pids = torch.zeros(self.size, dtype=torch.int64)
            torch_all_gather_flat(pids, torch.tensor([os.getpid()]), group=self.group)
            timeout_s = (timeout or timedelta(minutes=30)).total_seconds()
            counters = [c.view(np.int64) for c in counters]
            what = f"shared-memory {self.op.replace('_', '-')}"
            self.arrivals = Arrivals(counters, self.rank, pids.tolist(), timeout_s, what)
        self._lock = self._open_lock() if self.arrivals is not None else None
        # (closed by `close`, or with this object where nobody calls it)
        self._close_lock = (
            None if self._lock is None else weakref.finalize(self, os.close, self._lock)
        )

    def _open_lock(self) -> int:
        """A file every rank of the group holds open, to lock (`Progress`'s claims)."""
        path = SHARED_MEMORY / f"{self._prefix}lock"
        if self.rank == 0:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        with _unlinked_on_failure(path if self.rank == 0 else None):
            dist.barrier(group=self.group)
            fd = os.open(path, os.O_RDWR)
            dist.barrier(group=self.group)  # every rank holds it: gone with the last to close it
        if self.rank == 0:
            path.unlink()
        return fd

    def _map_shared(self, name: str, nbytes: int) -> list[np.ndarray] | None:
        """Every rank's file `name` of `nbytes`, mapped as bytes (this rank's made and filled
        with zeros), or None on every rank where one rank could not make its own. Arrays, not
        tensors: a peer's memory is not this rank's, and tensor scans (`PeakMeter`) skip them."""
        paths = [SHARED_MEMORY / f"{self._prefix}{name}-{k}" for k in range(self.size)]
        made = supported() and _create(paths[self.rank], nbytes)
        with _unlinked_on_failure(paths[self.rank] if made else None):
            everyone = torch.tensor([int(made)])
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)
            if not everyone.item():
                if made:
                    paths[self.rank].unlink()
                return None
            mapped = []
            for path in paths:
                with open(path, "r+b") as f:
                    mapped.append(np.frombuffer(mmap.mmap(f.fileno(), nbytes), dtype=np.uint8))
            dist.barrier(group=self.group)  # every rank has mapped every file
        paths[self.rank].unlink()
        return mapped

    def new_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer of `numel`, in shared memory where every rank could make its own
        (all ranks agree: where one could not, all make plain ones)."""
        if torch.device(device).type != "cpu" or numel == 0 or self.arrivals is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        index, self._made = self._made, self._made + 1
        nbytes, block = numel * dtype.itemsize, max(1, SUM_BLOCK_BYTES // dtype.itemsize)
        data = -(-nbytes // LINE) * LINE  # (the blocks' stamps follow, on a line of their own)
        mapped = self._map_shared(str(index), data + Progress.tail_bytes(numel, block))
        if mapped is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        progress = Progress([m[data:] for m in mapped], self.rank, numel, block, index)
        mapped = [m[:nbytes] for m in mapped]
        array, mapped[self.rank] = mapped[self.rank], None
        mine = torch.from_numpy(array).view(dtype)
        self._peers[mine.data_ptr()] = mapped
        self._progress[mine.data_ptr()] = progress
        # Forgotten with the memory (the array lives as long as any tensor on its storage does),
        # not with this tensor: a parameter made of it is another tensor object.
        for known in (self._peers, self._progress):
            weakref.finalize(array, known.pop, mine.data_ptr(), None)
        return mine

    def _peers_of(self, buffer: torch.Tensor) -> list[np.ndarray | None] | None:
        peers = self._peers.get(buffer.data_ptr())
        nbytes = buffer.numel() * buffer.element_size()
        if peers is None or any(p.size != nbytes for p in peers if p is not None):
            return None
        return peers

    def sums_to_mean(self, buffer: torch.Tensor) -> bool:
        # (`buffer` or any slice of it: its storage is the mapping. Not fp16: a sum of undivided
        # fp16 gradients can overflow where their means do not.)
        return buffer.dtype in MEAN_DTYPES and buffer.untyped_storage().data_ptr() in self._peers

    def start_mean(self, buffer: torch.Tensor) -> Handle:
        self._check_mean(buffer, True)
        return Handle(self.op, self._thread.submit(self._run_in_background, buffer, True), None)

    def _check_mean(self, buffer: torch.Tensor, mean: bool) -> None:
        if mean and (not self.sums_to_mean(buffer) or self._peers_of(buffer) is None):
            raise ValueError("start_mean: a buffer this all-reduce did not place, or fp16")

    def written(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        progress = self._progress.get(buffer.data_ptr())
        if progress is not None:
            progress.written(start, stop)

    def forget_written(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            progress = self._progress.get(buffer.data_ptr())
            if progress is not None:
                progress.forget()
        # A rank that forgot first, then began the buffer's next all-reduce, would find a peer's
        # stamps from the backward that raised and sum what that peer wrote then: the ranks
        # meet, after the thread's calls, as a collective of its own (the watchdog names a rank
        # that never comes).
        if self.arrivals is not None:
            meet = partial(self._here, self.arrivals.wait, "shared-memory take-back")
            _issue("barrier", 0, meet, False, self.group, None, "barrier_shared", blocking=True)

    def _run(self, buffer: torch.Tensor, mean: bool = False) -> None:
        peers = self._peers_of(buffer)
        if peers is None:
            all_reduce(buffer, group=self.group)
            return
        slots = [buffer if p is None else torch.from_numpy(p).view(buffer.dtype) for p in peers]
        # Recorded as its own op (the bench floor replays it so), counted as an all-reduce.
        volume = native_volume("all_reduce", buffer.numel() * buffer.element_size(), self.size)
        call = partial(self._sum_in_place, slots, mean, self._progress[buffer.data_ptr()])
        _issue("all_reduce", volume, call, False, self.group, buffer, "all_reduce_shared", True)

    def _sum_in_place(self, slots: list[torch.Tensor], mean: bool, progress: Progress) -> None:
        # Block b is read and written by the rank that claimed it alone, once every rank has
        # stamped it, and after the arrival by its owner alone.
        n = progress.begin()
        if self.size == 1:
            return  # (a sum over one rank is its own buffer; a mean divides it by one)
        first, end = (n - 1) * progress.blocks, n * progress.blocks
        step = progress.block
        while claimed := self._claim(progress, first, end, n):
            for b in range(*claimed):
                # (cut as claimed, and let go: a peer's memory held as a tensor between calls
                # would count as this rank's, to `PeakMeter`'s scan of what is alive)
                each = [slot[b * step : (b + 1) * step] for slot in slots]
                # The sum in rank order, whoever makes it (the bits of every run alike), made in
                # rank 0's block: the claim makes it this rank's to write, in every buffer.
                summed = each[0]
                for more in each[1:]:
                    summed.add_(more)
                if mean:  # (the rounding of dividing the sum, as NCCL's AVG)
                    divide_(summed, self.size)
                for block in each[1:]:
                    block.copy_(summed)
        self.arrivals.wait()  # every block is in every buffer: each rank's own again

    def _claim(self, progress: Progress, first: int, end: int, n: int) -> tuple[int, int] | None:
        """The next blocks of all-reduce `n` of `progress`'s buffer for this rank to sum,
        (b, stop) (the claims count blocks over the buffer's all-reduces: this one's are
        `first` to `end`): only blocks every rank has written, so a rank never holds a claim
        it must wait on while another could sum; None once every block is claimed. A claim
        takes a share of what is left (half of an even share; one block at least): few turns
        of the lock, and the ranks still finish together."""
        claims = progress.claims
        while (k := int(claims[0])) < end:
            b = k - first
            share = max(1, (end - k) // (2 * self.size))
            ready = progress.ready_run(b, share, n)
            if not ready:  # (what no rank can sum yet: none holds it meanwhile)
                pause = PAUSE_S if self._thread.running_here() else WRITTEN_PAUSE_S
                self.arrivals.until(partial(progress.unwritten, b, n), longest=pause)
                continue
            with self._claims_locked():
                if claims[0] != k:
                    continue  # (another rank claimed these first)
                claims[0] = k + ready
            return b, b + ready
        return None

    @contextlib.contextmanager
    def _claims_locked(self) -> Iterator[None]:
        """The claim lock held: for a read and a write of the count, so a waiter spins (yields
        its core) rather than sleeps for it, as long as an arrival is waited for at most (a
        holder that died let go of it; one stopped for good, or a process forked from it that
        kept its file open, would not)."""
        since = None
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.perf_counter()
                since = now if since is None else since
                if now - since > self.arrivals.timeout_s:
                    raise RuntimeError(
                        f"{self.arrivals.what}: the blocks' claim lock was held by another "
                        f"process for over {self.arrivals.timeout_s:.0f} s"
                    ) from None
                time.sleep(0)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def close(self) -> None:
        super().close()
        self._peers.clear()
        self._progress.clear()
        if self._close_lock is not None:
            self._close_lock()


class SharedMemoryCollectives(SharedMemoryAllReduce):
    """ZeRO's collectives through shared memory, on the all-reduce's buffers, group, thread and
    arrivals; where they came through gloo, each was a copy through loopback sockets on the
    cores that compute (`docs/strategies.md`). Every rank issues the same calls in the same
    order, and its thread runs them in that order.

    reduce-scatter  of a buffer it placed (`new_buffer`, or a prefix of one that N ranks
                    divide): between two arrivals, rank r adds slice r of every rank's buffer,
                    in rank order, into an output of its own. Each rank reads its slice of every
                    buffer once and writes none of them: a buffer can be filled again once the
                    second arrival has passed.
    all-gather      of any shard that fits its slots (`reserve_gathers`): a rank copies its
                    shard into its slot, arrives, and copies every other rank's out of theirs
                    into its place in the output. One arrival is enough with two slots taken in
                    turn: before a rank fills a slot again, two gathers later, it has waited for
                    every peer to arrive at the gather between, which a peer does only once it
                    has copied out of that slot.
    """

    op = "reduce_scatter"
    SLOTS = 2

    def __init__(self, timeout: timedelta | None = None) -> None:
        super().__init__(timeout)
        self.slots: list[torch.Tensor] = []  # this rank's gather slots, bytes
        self._gathers = 0  # gathers issued: the next takes slot `_gathers % SLOTS`

    def reserve_gathers(self, nbytes: int) -> None:
        """Make the gather slots, `nbytes` each (collective; none where shared memory cannot
        be had, on every rank: gathers then go through gloo)."""
        made = [self.new_buffer(nbytes, torch.uint8, CPU) for _ in range(self.SLOTS)]
        # Both or none (all ranks agree on each: `_map_shared`): the turns of two slots are
        # what makes one arrival a gather enough, and `start_all_gather` takes them in turn.
        # (One made alone is forgotten with its memory, dropped here.)
        self.slots = made if all(slot.data_ptr() in self._peers for slot in made) else []

    def placed(self, full: torch.Tensor) -> bool:
        """Whether `full` starts a buffer of `new_buffer`'s, within it, and N ranks divide it."""
        peers = self._peers.get(full.data_ptr())
        nbytes = full.numel() * full.element_size()
        return (
            peers is not None
            and full.is_contiguous()
            and full.numel() % self.size == 0
            and all(p.size >= nbytes for p in peers if p is not None)
        )

    def start_reduce_scatter(
        self, full: torch.Tensor, out: torch.Tensor, here: bool = False, key: int = 0
    ) -> Handle:
        """`out` (this rank's slice of `full`'s size: a tensor of its own, or that slice of
        `full` itself, which no peer reads) becomes the sum of that slice over every rank's
        `full`: in rank order, or into `full`'s own slice this rank's part first, then the
        others' in rank order. `here`: summed now, on the calling thread (`_post`). `key`
        names what `full` holds (ZeRO: the unit): every rank must reduce the same from the
        same buffer, and one that does not is refused on every rank before any sum."""
        if not self.placed(full) or out.numel() * self.size != full.numel():
            raise ValueError(
                f"shared-memory reduce-scatter: {tuple(full.shape)} is not a buffer it placed "
                f"that {self.size} ranks divide into outputs of {tuple(out.shape)}"
            )
        marked = mark(REDUCE_SCATTER, key, self._progress[full.data_ptr()].number)
        volume = native_volume("reduce_scatter", full.numel() * full.element_size(), self.size)
        call = partial(self._sum_slices, full, out, marked)
        return self._post("reduce_scatter", volume, call, full, here)

    def _post(
        self,
        op: str,
        volume: int,
        call: partial,
        tensor: torch.Tensor | None,
        here: bool,
        recorded: str | None = None,
    ):
        """Run `call` (collective `op`) on the thread, or `here`: on the calling thread once the
        thread's earlier calls are done (every rank issues in one order), for a caller that
        would wait for it next. A hand-off to the thread and back costs more than it overlaps
        then: up to 1.8 ms a step for DDP's one all-reduce (`ThreadedAllReduce.start_last`).
        Recorded as issued, not on the thread: its place among this rank's other calls is
        then the same on every rank (the bench floor replays a step's calls in their recorded
        order). `recorded`: its name there (default: `op`, then "_shared")."""
        recorded = recorded or f"{op}_shared"
        if here:
            here_call = partial(self._here, call)
            return _issue(op, volume, here_call, False, self.group, tensor, recorded, blocking=True)
        submit = partial(self._thread.submit, call)
        return _issue(op, volume, submit, True, self.group, tensor, recorded)

    def _sum_slices(self, full: torch.Tensor, out: torch.Tensor, marked: int) -> None:
        # (the peers' buffers as tensors only while summed: a peer's memory is not this rank's)
        n, peers = full.numel(), self._peers[full.data_ptr()]
        slots = [full if p is None else torch.from_numpy(p).view(full.dtype)[:n] for p in peers]
        slices = [slot.tensor_split(self.size)[self.rank] for slot in slots]
        # (every rank's buffer holds its part; where one holds another part, or another
        # buffer is reduced, every rank is refused here, before any sum)
        self.arrivals.wait("shared-memory reduce-scatter", marked)
        if out.data_ptr() == slices[self.rank].data_ptr():  # (`full`'s own slice: this rank's
            for k, more in enumerate(slices):  # part first, then the others' in rank order)
                if k != self.rank:
                    out.add_(more)
        else:
            torch.add(slices[0], slices[1], out=out)  # (rank order: the exchange's bits)
            for more in slices[2:]:
                out.add_(more)
        # (every rank has read its slice; marked as the first: a rank that left this call
        # after the first arrival, raising, is not taken for a peer's next call here)
        self.arrivals.wait("shared-memory reduce-scatter", marked)

    def gathers(self, output: torch.Tensor, shard: torch.Tensor) -> bool:
        """Whether `start_all_gather` takes these: CPU tensors of one dtype, contiguous, the
        output N shards long, a shard that fits a slot."""
        return (
            bool(self.slots)
            and output.device.type == shard.device.type == "cpu"
            and output.dtype == shard.dtype
            and output.is_contiguous()
            and shard.is_contiguous()
            and output.numel() == shard.numel() * self.size
            and shard.numel() * shard.element_size() <= self.slots[0].numel()
        )

    def start_all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, here: bool = False
    ) -> Handle:
        """`output` becomes every rank's `shard`, in rank order (`all_gather_into_tensor`'s
        layout). `shard` must not change until the handle's wait; it may be this rank's place
        in `output`. `here`: gathered now, on the calling thread (`_post`)."""
        if not self.gathers(output, shard):
            raise ValueError(
                f"shared-memory all-gather: output {output.dtype} {tuple(output.shape)} does "
                f"not hold {self.size} shards {shard.dtype} {tuple(shard.shape)} (contiguous, "
                "on the CPU, each within a slot)"
            )
        slot, self._gathers = self.slots[self._gathers % self.SLOTS], self._gathers + 1
        volume = native_volume("all_gather", output.numel() * output.element_size(), self.size)
        call = partial(self._gather, output, shard, slot)
        return self._post("all_gather", volume, call, output, here)

    def _gather(self, output: torch.Tensor, shard: torch.Tensor, slot: torch.Tensor) -> None:
        nbytes = shard.numel() * shard.element_size()
        mine = shard.reshape(-1).view(torch.uint8)
        slot[:nbytes].copy_(mine)
        self.arrivals.wait("shared-memory all-gather")  # every rank's slot holds its shard
        places = output.view(self.size, -1)
        for k, peer in enumerate(self._peers[slot.data_ptr()]):
            if places[k].data_ptr() == shard.data_ptr():
                continue  # (the shard is this rank's place in the output already)
            source = mine if peer is None else torch.from_numpy(peer[:nbytes])
            places[k].view(torch.uint8).copy_(source)

    # ---- shards that live in shared memory: read where they lie
    def resident(self, output: torch.Tensor, shard: torch.Tensor) -> bool:
        """Whether `start_gather_resident` takes these: `shard` a whole buffer of `new_buffer`'s
        (so every rank's lies in shared memory), `output` N of them, of its dtype."""
        return (
            self._peers_of(shard) is not None
            and output.dtype == shard.dtype
            and output.device.type == "cpu"
            and output.is_contiguous()
            and output.numel() == shard.numel() * self.size
        )

    def meet_before_exchange(self, key: int) -> None:
        """Every rank arrives, on the calling thread (after the thread's calls), saying that it
        exchanges part `key` next through the process group: where a peer arrives for another
        call (a reduce-scatter here, or another part's exchange), every rank is refused now,
        instead of one waiting in shared memory for a peer that waits in gloo until the
        timeout."""
        marked = mark(EXCHANGE, key)
        what = "shared-memory meeting before an exchange through the process group"
        call = partial(self._here, self.arrivals.wait, what, marked)
        _issue("barrier", 0, call, False, self.group, None, "barrier_shared", blocking=True)

    def start_meeting(self, here: bool = False) -> Handle:
        """Every rank arrives, and none goes on before: whatever a rank wrote into its buffers
        before arriving is what the others read after (`start_gather_resident`)."""
        call = partial(self.arrivals.wait, "shared-memory meeting")
        return self._post("barrier", 0, call, None, here, recorded="barrier_shared")

    def start_gather_resident(
        self, output: torch.Tensor, shard: torch.Tensor, here: bool = False
    ) -> Handle:
        """`output` becomes every rank's `shard`, in rank order, copied from where each lies: no
        slot to fill first, and no rank waits for another. Only the caller knows when a shard
        changes: between a change and a peer's gather of it, the ranks meet (`start_meeting`).
        ZeRO-3 meets once a forward, where it gathered once a unit (its shards change only in
        the optimizer's step, which no rank begins before every rank's backward is reduced)."""
        if not self.resident(output, shard):
            raise ValueError(
                f"shared-memory gather: {tuple(shard.shape)} {shard.dtype} is not a buffer it "
                f"placed, or output {output.dtype} {tuple(output.shape)} does not hold "
                f"{self.size} of them"
            )
        volume = native_volume("all_gather", output.numel() * output.element_size(), self.size)
        call = partial(self._gather_resident, output, shard)
        return self._post("all_gather", volume, call, output, here, "all_gather_resident")

    def _gather_resident(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        places = output.view(self.size, -1)
        for k, peer in enumerate(self._peers[shard.data_ptr()]):
            places[k].copy_(shard if peer is None else torch.from_numpy(peer).view(shard.dtype))
