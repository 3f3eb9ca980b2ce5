"""What an all-reduce algorithm is to a strategy: a flat buffer in, a `Handle` back.

The native algorithm is asynchronous in the backend already. Ours run on one communication
thread per algorithm (`ThreadedAllReduce`), over a process group of their own: one thread keeps
the order of operations identical on every rank, and the separate group keeps them from
interleaving with collectives the training thread issues meanwhile.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.comm.accounting import stats
from shardwise.comm.collectives import Handle, ProcessGroup, all_reduce


class AllReduceAlgorithm:
    """Sums a flat buffer over the group, asynchronously: `start(buffer)` returns a Handle.

    A data-parallel strategy `describe`s each of its buffers once, in order, before the first
    `start`: stateful algorithms (compression) keep their state per buffer index, which is
    what `state_dict` saves (the same buffers exist again in a fresh prepare of the model).
    """

    def new_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer that `start` sums fastest. Collective where an algorithm places
        its buffers (shared memory): every rank makes the same ones, in the same order."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def describe(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        """`buffer` holds tensors of `shapes`, in order."""

    def written(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Elements [start, stop) of `buffer` (one of `new_buffer`'s) hold their part of its
        next reduction, and nothing changes them before it: an algorithm may begin there before
        the whole buffer is started (`SharedMemoryAllReduce`: a rank done early sums what its
        peers have made already)."""

    def forget_written(self, buffers: list[torch.Tensor]) -> None:
        """What `written` said of `buffers` since their last reductions began no longer holds
        (a backward that raised wrote them; the next writes them again), and an algorithm that
        keeps state returns to it as of the last `commit` (that backward's reductions are
        discarded). Collective: every rank forgets alike, with no reduction in flight, and none
        reduces again before all have."""

    def commit(self) -> None:
        """The reductions started so far are kept: each has been waited for, and the backward
        that started them ended (`forget_written` takes back only what comes after)."""

    def start(self, buffer: torch.Tensor) -> Handle:
        raise NotImplementedError

    def sums_to_mean(self, buffer: torch.Tensor) -> bool:
        """Whether `start_mean` divides `buffer`'s sum (`buffer`: one of `new_buffer`'s, or a
        slice of one) by the group's size as it sums, with no pass of its own over the buffer:
        a strategy whose ranks' shares are equal then leaves its gradients undivided."""
        return False

    def start_mean(self, buffer: torch.Tensor) -> Handle:
        """As `start`, the sum divided by the group's size (only where `sums_to_mean`)."""
        raise NotImplementedError(f"{type(self).__name__} does not divide as it sums")

    def start_last(self, buffer: torch.Tensor, mean: bool = False) -> Handle:
        """`start` (`start_mean` where `mean`) for a step's last reduction, which its caller
        waits for next with nothing to compute between: an algorithm that runs on a thread of
        its own runs this one on the caller's (`ThreadedAllReduce`)."""
        return self.start_mean(buffer) if mean else self.start(buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)[:3]}")

    def close(self) -> None:
        pass


class NativeAllReduce(AllReduceAlgorithm):
    """The backend's own all-reduce (gloo's ring/halving-doubling, NCCL's rings and trees)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    def start(self, buffer: torch.Tensor) -> Handle:
        return all_reduce(buffer, group=self.group, async_op=True)


class CommThread:
    """One daemon thread that runs the calls submitted to it in order, each answering with a
    Future. (A ThreadPoolExecutor's worker is no daemon: an algorithm that was never closed, as
    when training raised, would keep the process from exiting.)"""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None  # (the thread runs its calls in order)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        self._last = future
        return future

    def running_here(self) -> bool:
        """Whether the caller is this thread."""
        return threading.current_thread() is self._thread

    def finish(self) -> None:
        """Wait until every call submitted so far has run (raising the last one's error)."""
        if self._last is not None:
            self._last.result()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # (handed to whoever waits)
                future.set_exception(e)

    def shutdown(self) -> None:
        """Ends the thread once the calls submitted before have run."""
        self._calls.put(None)
        self._thread.join()


class ThreadedAllReduce(AllReduceAlgorithm):
    """Runs a blocking all-reduce function on a dedicated thread and process group."""

    op = "all_reduce"

    def __init__(self) -> None:
        self._thread = CommThread("shardwise-comm")

    def _run(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def _run_in_background(self, buffer: torch.Tensor, *args) -> None:
        with stats.background():
            self._run(buffer, *args)

    def start(self, buffer: torch.Tensor) -> Handle:
        return Handle(self.op, self._thread.submit(self._run_in_background, buffer), None)

    def start_last(self, buffer: torch.Tensor, mean: bool = False) -> Handle:
        # Run here, after the thread's earlier calls (every rank issues in one order): handed to
        # the thread and back, the bench MLP's one all-reduce a step cost DDP 0.0-1.8 ms more
        # (median 1.3; 2 ranks on 2 cores, five interleaved rounds of 30 steps).
        self._check_mean(buffer, mean)
        self._here(self._run, buffer, *((True,) if mean else ()))
        return Handle(self.op, None, None)

    def _here(self, fn: Callable, *args):
        """`fn(*args)` on the calling thread, once the thread's earlier calls are done (every
        rank issues in one order), and seen as on the thread: by no dispatch mode of the
        caller's (each sees its own thread's operators only; `PeakMeter` would count a peer's
        buffer, mapped as a tensor while summed, as this rank's memory)."""
        self._thread.finish()
        with _disable_current_modes():
            return fn(*args)

    def _check_mean(self, buffer: torch.Tensor, mean: bool) -> None:
        if mean:
            raise NotImplementedError(f"{type(self).__name__} does not divide as it sums")

    def close(self) -> None:
        self._thread.shutdown()
