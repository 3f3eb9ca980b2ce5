"""The shared-memory all-reduce (`comm/shared_memory.py`) against gloo's, on real processes."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import comm
from shardwise.comm import shared_memory
from shardwise.comm.shared_memory import SharedMemoryAllReduce, SharedMemoryCollectives
from spawn import run

pytestmark = pytest.mark.skipif(not shared_memory.supported(), reason="needs /dev/shm on x86-64")

CPU = torch.device("cpu")


def _mapped_shared_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of shardwise's shared-memory files, as the
    kernel lists them."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/dev/shm/shardwise-" in fields[5]:
            start, end = (int(a, 16) for a in fields[0].split("-"))
            found.append((start, end, fields[5]))
    return found


def _holds(mappings: list[tuple[int, int, str]], t: torch.Tensor) -> bool:
    return any(start <= t.data_ptr() < end for start, end, _ in mappings)


def sums_like_gloo():
    """Each dtype and awkward size (fewer elements than ranks too; chunks of several blocks
    and a ragged last one), summed in shared memory and by gloo from the same inputs."""
    rank = dist.get_rank()
    summing = SharedMemoryAllReduce(timeout=timedelta(seconds=30))
    worst, exact = 0.0, True
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in (1, 2, 5, 4097, 300_007):
            g = torch.Generator().manual_seed(100 * rank + numel)
            mine = (torch.randn(numel, generator=g) * 100).to(dtype)
            shared = summing.new_buffer(numel, dtype, CPU)
            shared.copy_(mine)
            summing.start(shared).wait()
            theirs = mine.clone()
            dist.all_reduce(theirs)
            if dtype == torch.int64 or dist.get_world_size() == 2:
                exact &= torch.equal(shared, theirs)  # (a + b is b + a: the same bits)
            else:  # (another order of the sum rounds otherwise: relative to what is summed)
                scale = mine.abs().double()
                dist.all_reduce(scale)
                diff = (shared.double() - theirs.double()).abs() / scale.clamp(min=1)
                worst = max(worst, diff.max().item())
    mapped = _mapped_shared_files()
    summing.close()
    return exact, float(worst), mapped


@pytest.mark.parametrize("world_size", [2, 3])
def test_sums_equal_gloos_and_no_file_is_left_behind(world_size):
    for exact, worst, mapped in run(sums_like_gloo, world_size):
        assert exact
        assert worst <= 2**-6  # (bf16's rounding, twice)
        # every rank maps its own and its peers' buffers, whose files are already unlinked
        assert mapped and all(path.endswith("(deleted)") for _, _, path in mapped)


def means_are_sums_divided():
    """start_mean: the shared sum divided by the group's size, bit for bit, on the thread or on
    the caller's (`start_last`); and which buffers it can average as it sums (none in fp16,
    whose undivided sums can overflow)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summing = SharedMemoryAllReduce(timeout=timedelta(seconds=30))
    exact = True
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 5, 4097, 300_007):
            g = torch.Generator().manual_seed(100 * rank + numel)
            mine = (torch.randn(numel, generator=g) * 100).to(dtype)
            summed, averaged = (summing.new_buffer(numel, dtype, CPU) for _ in range(2))
            summed.copy_(mine)
            averaged.copy_(mine)
            summing.start(summed).wait()
            summing.start_mean(averaged).wait()
            exact &= torch.equal(averaged, summed / world)
            # Run on this thread (a step's last): behind a sum still on the thread.
            again, last = (
                summing.new_buffer(numel, dtype, CPU),
                summing.new_buffer(numel, dtype, CPU),
            )
            again.copy_(mine)
            last.copy_(mine)
            ahead = summing.start(again)
            summing.start_last(last, mean=True).wait()
            ahead.wait()
            exact &= torch.equal(again, summed) and torch.equal(last, averaged)
    can = [
        summing.sums_to_mean(summing.new_buffer(8, dtype, CPU))
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    ]
    shared = summing.new_buffer(8, torch.float32, CPU)
    can += [summing.sums_to_mean(shared[3:]), summing.sums_to_mean(torch.zeros(8))]
    try:
        summing.start_mean(torch.zeros(8))
        refused = ""
    except ValueError as e:
        refused = str(e)
    summing.close()
    return exact, can, refused


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_mean_is_the_shared_sum_divided_by_the_group(world_size):
    for exact, can, refused in run(means_are_sums_divided, world_size):
        assert exact
        # fp32, bf16: yes; fp16, int64: no; a slice of a shared buffer: yes; a plain one: no
        assert can == [True, True, False, False, True, False]
        assert "did not place" in refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_mean_divides_with_the_bits_of_a_division_for_every_world_size(dtype):
    from shardwise.comm.mean import divide_, divide_into

    g = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).tiny
    values = torch.cat(
        [
            torch.randn(100_000, generator=g) * 1e3,
            torch.rand(1000, generator=g) * tiny * 4,  # subnormals, once divided
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny]),
        ]
    ).to(dtype)
    for n in range(1, 9):
        want = values / n
        got = values.clone()
        divide_(got, n)
        into = torch.empty_like(values)
        divide_into(values, n, into)
        for have in (got, into):  # (NaN at the same places, every other bit equal)
            assert torch.equal(have.isnan(), want.isnan()), n
            assert torch.equal(_bits(have.nan_to_num(0.0)), _bits(want.nan_to_num(0.0))), n


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _refusals(start, *cases: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    """What `start` says to each pair of tensors it should refuse ("" where it did not)."""
    refused = []
    for a, b in cases:
        try:
            start(a, b)
            refused.append("")
        except ValueError as e:
            refused.append(str(e))
    return refused


def scatters_like_the_exchange():
    """Reduce-scatters in shared memory, of whole buffers and of prefixes of a larger one,
    against every rank's inputs gathered and summed here in rank order (how ZeRO summed the
    exchanged slices before): the same bits. And what it refuses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    scatter = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    larger = {dtype: scatter.new_buffer(world * 100_003, dtype, CPU) for dtype in DTYPES}
    exact = True
    for dtype in DTYPES:
        for per_rank in (1, 5, 4097, 100_003):
            numel = world * per_rank
            for staged in (scatter.new_buffer(numel, dtype, CPU), larger[dtype][:numel]):
                g = torch.Generator().manual_seed(100 * rank + per_rank)
                mine = (torch.randn(numel, generator=g) * 100).to(dtype)
                staged.copy_(mine)
                out = torch.empty(per_rank, dtype=dtype)
                scatter.start_reduce_scatter(staged, out).wait()
                everyone = torch.empty(world, numel, dtype=dtype)
                dist.all_gather_into_tensor(everyone.view(-1), mine)
                slices = everyone[:, rank * per_rank : (rank + 1) * per_rank]
                expected = slices[0] + slices[1]
                for more in slices[2:]:
                    expected += more
                exact &= torch.equal(out, expected) and torch.equal(staged, mine)
                # Into its own slice of the buffer (ZeRO-1's): its part first, then the rest's.
                # (on this thread: `here`)
                own = staged[rank * per_rank : (rank + 1) * per_rank]
                scatter.start_reduce_scatter(staged, own, here=True).wait()
                in_place = slices[rank].clone()
                for k in range(world):
                    if k != rank:
                        in_place += slices[k]
                exact &= torch.equal(own, in_place)
    refused = _refusals(
        scatter.start_reduce_scatter,
        (torch.zeros(world * 4), torch.empty(4)),  # not placed by it
        (larger[torch.float32][: world * 4 + 1], torch.empty(4)),  # not divided by the world
        (larger[torch.float32][1 : world * 4 + 1], torch.empty(4)),  # not a buffer's start
        (larger[torch.float32][: world * 4], torch.empty(5)),  # an output of the wrong size
    )
    scatter.close()
    return exact, refused


DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_reduce_scatter_sums_each_slice_as_the_exchange_did(world_size):
    for exact, refused in run(scatters_like_the_exchange, world_size):
        assert exact
        assert all("is not a buffer it placed" in e for e in refused), refused


def gathers_like_gloo():
    """All-gathers in shared memory against gloo's of the same shards: each dtype, sizes from
    one element to a full slot, many in flight at once (the two slots taken in turn, each
    reused while the gathers before it are still being waited for; some run on the caller's
    thread, `here`), an output that is already written, and what it refuses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    collectives.reserve_gathers(4 * 100_003)
    exact = True
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
    cases = [(dtype, numel) for dtype in dtypes for numel in (1, 7, 4097, 400_012 // 8)]
    cases.append((torch.float32, 100_003))  # (a slot's whole)
    started = []
    for i, (dtype, numel) in enumerate(cases):
        g = torch.Generator().manual_seed(1000 * rank + i)
        shard = (torch.randn(numel, generator=g) * 100).to(dtype)
        output = torch.full((world * numel,), -1).to(dtype)
        here = i % 3 == 2  # (some on this thread, behind those still on the thread)
        started.append((shard, output, collectives.start_all_gather(output, shard, here)))
    for shard, output, handle in started:
        handle.wait()
        theirs = torch.empty_like(output)
        dist.all_gather_into_tensor(theirs, shard)
        exact &= torch.equal(output, theirs)
    # In place: the shard is this rank's place in the output (ZeRO-1/2's updated slices).
    output = torch.full((world * 1001,), -1.0)
    place = output[rank * 1001 : (rank + 1) * 1001]
    place.copy_(torch.arange(1001) + 10_000 * rank)
    collectives.start_all_gather(output, place).wait()
    exact &= torch.equal(
        output,
        torch.arange(1001).repeat(world) + 10_000 * torch.arange(world).repeat_interleave(1001),
    )
    refused = _refusals(
        collectives.start_all_gather,
        (torch.empty(world * 4), torch.empty(4, dtype=torch.bfloat16)),  # dtypes differ
        (torch.empty(world * 4 + 1), torch.empty(4)),  # not N shards long
        (torch.empty(world * 100_004), torch.empty(100_004)),  # past a slot
        (torch.empty(world * 8)[::2], torch.empty(4)),  # not contiguous
    )
    collectives.close()
    return exact, refused


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_all_gather_is_gloos_bits(world_size):
    for exact, refused in run(gathers_like_gloo, world_size):
        assert exact
        assert all("does not hold" in e for e in refused), refused


def scatters_of_other_parts_or_buffers():
    """Two placed buffers: both ranks reduce-scatter part 7 from buffer 0 (summed), then rank 1
    takes buffer 1 for it, then both take buffer 0 with rank 1 naming part 8: what each rank
    is told of each."""
    rank = dist.get_rank()
    collectives = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    buffers = [collectives.new_buffer(8, torch.float32, CPU) for _ in range(2)]
    said = []
    for which, key in ((0, 7), (rank, 7), (0, 7 + rank)):
        buffers[which].fill_(rank + 1)
        try:
            collectives.start_reduce_scatter(buffers[which], torch.empty(4), key=key).wait()
            said.append("")
        except RuntimeError as e:
            said.append(str(e))
    collectives.close()
    return said


def test_ranks_that_reduce_other_parts_or_buffers_are_refused_on_every_rank():
    for rank, said in enumerate(run(scatters_of_other_parts_or_buffers, 2)):
        assert said[0] == ""
        other = 1 - rank
        # (another buffer, then another part: what each rank came for is named)
        assert f"rank {other} for the reduce-scatter of part 7 from buffer {other}" in said[1]
        assert f"rank {other} for the reduce-scatter of part {7 + other} from buffer 0" in said[2]
        assert all("ranks arrived for different calls" in e for e in said[1:])


def meetings_before_exchanges():
    """Both ranks say they exchange part 3 next through gloo (they go on), then parts 3 and 4;
    then rank 0 reduce-scatters part 5 in shared memory while rank 1 says it exchanges part 5
    through gloo (a staging buffer free on one rank only): what each rank is told, and when."""
    rank = dist.get_rank()
    collectives = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    buffer = collectives.new_buffer(8, torch.float32, CPU)

    def reduce_scatter() -> None:
        collectives.start_reduce_scatter(buffer, torch.empty(4), key=5).wait()

    meet = collectives.meet_before_exchange
    said, start = [], time.monotonic()
    for call in (
        partial(meet, 3),
        partial(meet, 3 + rank),
        reduce_scatter if rank == 0 else partial(meet, 5),
    ):
        try:
            call()
            said.append("")
        except RuntimeError as e:
            said.append(str(e))
    took_s = time.monotonic() - start
    collectives.close()
    return said, took_s


def test_a_rank_that_exchanges_a_part_through_gloo_meets_first_and_is_refused_with_its_peers():
    # Before, the rank bound for gloo waited there for a peer that waited in shared memory,
    # each until the group's timeout.
    (said_0, took_0), (said_1, took_1) = run(meetings_before_exchanges, 2)
    assert said_0[0] == said_1[0] == ""
    assert "rank 1 for the exchange of part 4 through the process group" in said_0[1]
    assert "rank 0 for the exchange of part 3 through the process group" in said_1[1]
    assert "rank 1 for the exchange of part 5 through the process group" in said_0[2]
    assert "rank 0 for the reduce-scatter of part 5 from buffer 0" in said_1[2]
    assert max(took_0, took_1) < 10  # (refused at once, well within the 30 s timeout)


def gathers_with_one_slot_refused():
    """The gather slots where shared memory holds only the first of the two (the last rank
    cannot make its second): gathers go through gloo on every rank, with gloo's bits, and no
    slot is kept (one alone would be refilled before a slow peer copied out of it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    create = shared_memory._create
    refused = f"{collectives._prefix}1-{world - 1}"  # (the second slot's file, the last rank's)
    shared_memory._create = lambda path, nbytes: path.name != refused and create(path, nbytes)
    try:
        collectives.reserve_gathers(4 * 1000)
    finally:
        shared_memory._create = create
    exact, through_shared_memory = True, 0
    for i in range(3):  # (the second gather took the slot that was not there)
        shard = torch.arange(1000, dtype=torch.float32) + 1000 * rank + 100_000 * i
        output = torch.full((world * 1000,), -1.0)
        if collectives.gathers(output, shard):  # (as ZeRO asks before each gather)
            collectives.start_all_gather(output, shard).wait()
            through_shared_memory += 1
        else:
            comm.all_gather_into_tensor(output, shard)
        theirs = torch.empty_like(output)
        dist.all_gather_into_tensor(theirs, shard)
        exact &= torch.equal(output, theirs)
    slots = len(collectives.slots)
    collectives.close()
    return exact, through_shared_memory, slots


def test_gathers_go_through_gloo_where_only_one_slot_could_be_made():
    for exact, through_shared_memory, slots in run(gathers_with_one_slot_refused, 2):
        assert exact
        assert through_shared_memory == 0 and slots == 0


def fails_while_the_files_are_made(failing_call: int, token: int):
    """`SharedMemoryAllReduce` made, then a buffer, with the group's `failing_call`-th barrier
    raising on every rank as a lost peer's does (1: meeting over the counters' files; 2: over
    the lock's; 3: over a buffer's): (this rank's error, what is left of the group's files in
    /dev/shm)."""
    calls, barrier = [0], dist.barrier

    def breaks(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise RuntimeError("Connection closed by peer")
        return barrier(*args, **kwargs)

    randbits = shared_memory.secrets.randbits
    shared_memory.secrets.randbits = lambda _bits: token  # (the group's files' names known)
    dist.barrier = breaks
    failed = ""
    try:
        summing = SharedMemoryAllReduce(timeout=timedelta(seconds=30))
        summing.new_buffer(1 << 16, torch.float32, CPU)
    except (RuntimeError, OSError) as e:  # (a peer's file gone as this rank maps it, too)
        failed = str(e)
    finally:
        dist.barrier, shared_memory.secrets.randbits = barrier, randbits
    dist.barrier()  # (every rank has failed, or unlinked its own, before any looks)
    left = sorted(p.name for p in Path("/dev/shm").glob(f"shardwise-{token:x}-*"))
    return failed, left


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_no_file_is_left_in_shared_memory_when_the_ranks_fail_to_meet(failing_call):
    token = int.from_bytes(np.random.default_rng().bytes(7), "little")  # (a job's own names)
    for failed, left in run(fails_while_the_files_are_made, 2, failing_call, token):
        assert failed
        assert left == []


def claims_while_a_peer_holds_the_lock():
    """Rank 1 takes the blocks' claim lock and keeps it 3 s (a process stopped while it held
    it); rank 0 asks for it with a 1 s timeout: (its error, seconds it waited)."""
    summing = SharedMemoryAllReduce(timeout=timedelta(seconds=1))
    error, waited = "", 0.0
    if dist.get_rank() == 1:
        fcntl.flock(summing._lock, fcntl.LOCK_EX)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(3)
        fcntl.flock(summing._lock, fcntl.LOCK_UN)
    else:
        started = time.perf_counter()
        try:
            with summing._claims_locked():
                pass
        except RuntimeError as e:
            error = str(e)
        waited = time.perf_counter() - started
    dist.barrier()
    summing.close()
    return error, waited


def test_a_claim_lock_held_past_the_timeout_fails_the_claim_instead_of_hanging():
    error, waited = run(claims_while_a_peer_holds_the_lock, 2)[0]
    assert "claim lock was held by another process for over 1 s" in error
    assert waited < 2.5


def reads_each_shard_where_it_lies():
    """Gathers of shards that live in shared memory (ZeRO-3's), read where each rank's lies,
    against gloo's all-gather of the same values, over rounds in which every rank rewrites its
    shards and the last rank does so late (it sleeps first): after a meeting, every rank reads
    every rank's newest values. Several gathers after one meeting, some on the caller's thread
    (`here`), of shards made into parameters (other tensor objects on the same memory, as
    ZeRO-3's are); and what it refuses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives = SharedMemoryCollectives(timeout=timedelta(seconds=30))
    sizes = (1, 7, 4097, 100_003)
    shards = [nn.Parameter(collectives.new_buffer(n, torch.float32, CPU)) for n in sizes]
    placed = all(collectives.resident(torch.empty(world * s.numel()), s) for s in shards)
    exact = True
    for round_ in range(4):
        if rank == world - 1:
            time.sleep(0.2)  # (a stale shard would be read, were the meeting not waited for)
        with torch.no_grad():
            for i, shard in enumerate(shards):
                shard.copy_(torch.arange(shard.numel()) + 1000 * rank + 100_000 * round_ + i)
        meeting = collectives.start_meeting(here=round_ % 2 == 1)
        started = []
        for i, shard in enumerate(shards):
            output = torch.full((world * shard.numel(),), -1.0)
            handle = collectives.start_gather_resident(output, shard.detach(), here=i % 2 == 0)
            started.append((shard, output, handle))
        meeting.wait()
        for shard, output, handle in started:
            handle.wait()
            theirs = torch.empty_like(output)  # (also: no rank rewrites before all have read)
            dist.all_gather_into_tensor(theirs, shard.detach())
            exact &= torch.equal(output, theirs)
    refused = _refusals(
        collectives.start_gather_resident,
        (torch.empty(world * 4), torch.zeros(4)),  # a shard it did not place
        (torch.empty(world * 7 + 1), shards[1].detach()),  # not N shards long
        (torch.empty(world * 7, dtype=torch.bfloat16), shards[1].detach()),  # dtypes differ
        (torch.empty(world * 4), shards[2].detach()[:4]),  # a part of a placed buffer
    )
    collectives.close()
    return placed, exact, refused


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_shard_in_shared_memory_is_read_where_it_lies_once_the_ranks_have_met(world_size):
    for placed, exact, refused in run(reads_each_shard_where_it_lies, world_size):
        assert placed and exact
        assert all("is not a buffer it placed" in e for e in refused), refused


def sums_what_each_rank_has_written():
    """Each round one rank (the late one) writes its buffer a piece at a time, in a shuffled
    order of spans that cross blocks, telling each (`written`), then starts; the others start
    at once. Their sum must wait for what the late rank has not written (which stays as it
    was), and may take what it has: before the late rank starts, the blocks it wrote whole
    hold the sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summing = SharedMemoryAllReduce(timeout=timedelta(seconds=30))
    block = shared_memory.SUM_BLOCK_BYTES // 4
    numel = 5 * block + 123
    shared = summing.new_buffer(numel, torch.float32, CPU)
    cuts = [0, 700, block + 5, 2 * block + 17, 4 * block + 9]  # (one span across four blocks)
    spans = list(itertools.pairwise(cuts))
    exact, untouched, summed_early = True, True, True
    for late in range(world):
        mean = late % 2 == 1
        g = torch.Generator().manual_seed(10 * late + rank)
        mine = torch.randn(numel, generator=g)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        expected = every[0] + every[1]  # (the sum in rank order, as every rank makes it)
        for more in every[2:]:
            expected += more
        if mean:
            expected /= world
        if rank != late:
            shared.copy_(mine)
        dist.barrier()
        if rank == late:
            shared.zero_()
            order = [spans[i] for i in torch.randperm(len(spans), generator=g).tolist()]
            written = torch.zeros(numel, dtype=torch.bool)
            for a, b in order:
                shared[a:b] = mine[a:b]
                time.sleep(0.02)  # (the others have started: what is not written stays so)
                written[a:b] = True
                untouched &= not shared[~written].any().item()
                summing.written(shared, a, b)
            # Blocks 0-3 are written whole, the last two not yet: the others sum the four.
            deadline = time.monotonic() + 20
            while not torch.equal(shared[: 4 * block], expected[: 4 * block]):
                if time.monotonic() > deadline:
                    summed_early = False
                    break
                time.sleep(0.01)
            untouched &= torch.equal(
                shared[4 * block : 4 * block + 9], mine[4 * block : 4 * block + 9]
            )
            untouched &= not shared[4 * block + 9 :].any().item()
            shared[4 * block + 9 :] = mine[4 * block + 9 :]
            summing.written(shared, 4 * block + 9, numel)  # (to the ragged end)
        handle = summing.start_last(shared, mean=True) if mean else summing.start(shared)
        handle.wait()
        exact &= torch.equal(shared, expected)
    summing.close()
    return exact, untouched, summed_early


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_done_early_sum_what_the_others_have_written_and_only_that(world_size):
    for exact, untouched, summed_early in run(sums_what_each_rank_has_written, world_size):
        assert exact
        assert untouched
        assert summed_early


def plain_buffer_and_disagreement():
    """A buffer the algorithm did not place, and an algorithm one rank cannot place any in:
    both sum through gloo, and correctly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summing = SharedMemoryAllReduce()
    plain = torch.full((7,), float(rank + 1))
    summing.start(plain).wait()
    if rank == 1:  # this rank cannot make its files: every rank must do without them
        shared_memory.supported = lambda: False
    without = SharedMemoryAllReduce()
    buffer = without.new_buffer(7, torch.float32, CPU)
    buffer.fill_(rank + 1)
    without.start(buffer).wait()
    expected = world * (world + 1) / 2
    in_shared_memory = _holds(_mapped_shared_files(), buffer)
    summing.close()
    without.close()
    return plain.tolist() == [expected] * 7, buffer.tolist() == [expected] * 7, in_shared_memory


def test_a_block_is_stamped_once_its_every_element_is_written_and_not_twice():
    """`Progress.written`, in one process: a block of 4 elements of a 10-element buffer (blocks
    of 4, 4 and 2) is stamped with the next all-reduce's number once all its elements are in,
    however the writes cut it; an element written twice before its all-reduce is refused,
    whichever of a write's blocks it lies in."""
    tails = [np.zeros(shared_memory.Progress.tail_bytes(10, 4), np.uint8) for _ in range(2)]
    progress = shared_memory.Progress(tails, rank=1, numel=10, block=4)
    stamps = tails[1][:24].view(np.int64)  # (this rank's: 3 blocks)
    progress.written(0, 3)
    assert stamps.tolist() == [0, 0, 0]
    progress.written(3, 9)  # (block 0's last element, block 1 whole, block 2's first)
    assert stamps.tolist() == [1, 1, 0]
    progress.written(9, 10)
    assert stamps.tolist() == [1, 1, 1] and tails[0][:24].view(np.int64).tolist() == [0, 0, 0]
    assert progress.begin() == 1  # (all-reduce 1 begins: the next writes are for the 2nd)
    progress.written(4, 8)
    assert stamps.tolist() == [1, 2, 1]
    with pytest.raises(RuntimeError, match="written twice"):
        progress.written(5, 6)
    progress.forget()  # (nothing written for all-reduce 2 after all: every count whole again)
    assert stamps.tolist() == [1, 1, 1]
    progress.written(2, 6)  # (two neighbouring blocks, neither whole)
    assert stamps.tolist() == [1, 1, 1]
    progress.written(0, 2)
    progress.written(6, 10)
    assert stamps.tolist() == [2, 2, 2]
    assert progress.begin() == 2
    progress.written(5, 6)
    with pytest.raises(RuntimeError, match="written twice"):  # (block 1 in the write's middle)
        progress.written(0, 10)
    assert stamps.tolist() == [2, 2, 2]  # (refused before any count or stamp moved)
    progress.written(0, 5)
    progress.written(6, 10)
    assert stamps.tolist() == [3, 3, 3]


def test_buffers_outside_shared_memory_are_summed_by_gloo():
    for plain_ok, agreed_ok, in_shared_memory in run(plain_buffer_and_disagreement, 2):
        assert plain_ok and agreed_ok
        assert not in_shared_memory


def rank_that_never_arrives():
    summing = SharedMemoryAllReduce(timeout=timedelta(seconds=1))
    buffer = summing.new_buffer(16, torch.float32, CPU)
    error = ""
    if dist.get_rank() == 0:  # rank 1 never starts its all-reduce
        try:
            summing.start(buffer).wait()
        except RuntimeError as e:
            error = str(e)
    dist.barrier()
    summing.close()
    return error


def test_a_rank_that_never_arrives_fails_the_wait_instead_of_hanging():
    errors = run(rank_that_never_arrives, 2)
    assert "rank(s) [1] did not arrive within 1 s" in errors[0]


class _Abort(Exception):
    """Raised by a hook inside backward."""


def _raising_midway(model: nn.Sequential) -> tuple[nn.Sequential, list]:
    """`model`, and a list: while it holds anything, a backward through `model` raises once the
    gradients past its second module (the last layer's) are made."""
    aborting: list = []

    def hook(module, inputs, output):
        if aborting:
            output.register_hook(lambda grad: (_ for _ in ()).throw(_Abort()))

    model[1].register_forward_hook(hook)
    return model, aborting


def ddp_default_trains_in_shared_memory(algorithm):
    """sw.DDP() on CPU ranks of one host: its gradients live in shared memory (the kernel's
    map of this process says so), and training matches one process on the global batch, a
    backward that raised half way on every rank (then `zero_grad`) taken back; the same with
    gloo's all-reduce."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(13, 31), nn.Tanh(), nn.Linear(31, 5))

    mine, aborting = _raising_midway(model())
    # (a bucket a parameter or so: the last layer's launch before the hook raises)
    ours, opt = sw.prepare(mine, sw.DDP(bucket_mb=0.0005, algorithm=algorithm), lr=1e-2)
    reference = model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(4 * world, 13, generator=g),
            torch.randint(0, 5, (4 * world,), generator=g),
        )
        mine_x, mine_y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        if step in (1, 3):  # (on other data: what it wrote must not be summed)
            aborting.append(True)
            with contextlib.suppress(_Abort):
                F.cross_entropy(ours(3 * mine_x.flip(0)), mine_y).backward()
            aborting.clear()
            with torch.no_grad():  # (an evaluation starts no backward: it may run)
                ours(mine_x)
            if step == 3:  # another backward before zero_grad: partial gradients, refused
                try:
                    F.cross_entropy(ours(mine_x), mine_y).backward()
                    refused = ""
                except RuntimeError as e:
                    refused = str(e)
            opt.zero_grad()
        F.cross_entropy(ours(mine_x), mine_y).backward()
        grads_shared = all(_holds(_mapped_shared_files(), p.grad) for p in ours.parameters())
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = sw.full_state_dict(ours)
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return grads_shared, diff, refused


@pytest.mark.parametrize("algorithm", [None, "native"])
def test_ddp_on_one_host_sums_in_shared_memory_and_trains_exactly(algorithm):
    for grads_shared, diff, refused in run(ddp_default_trains_in_shared_memory, 2, algorithm):
        assert grads_shared == (algorithm is None)
        assert diff <= 1e-6
        assert "zero_grad() was not called" in refused


def takes_back_in_step():
    """A backward raises on both ranks after the last layer's gradient (many blocks, written
    and stamped) landed in a bucket it never launched; rank 1 takes it back late. Rank 0's next
    all-reduce must not sum what rank 1 wrote in the backward that raised."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 40_000))

    mine, aborting = _raising_midway(model())
    # One bucket: the last layer's 2.6 MB gradient and the first layer's, made after the hook.
    ours, opt = sw.prepare(mine, sw.DDP(bucket_mb=8), optimizer=torch.optim.SGD, lr=0.5)
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(4 * world, 16, generator=g),
        torch.randint(0, 40_000, (4 * world,), generator=g),
    )
    mine_x, mine_y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
    aborting.append(True)
    with contextlib.suppress(_Abort):
        F.cross_entropy(ours(-mine_x), mine_y.flip(0)).backward()
    aborting.clear()
    # What the test is about: the bucket was never launched, and its blocks that the last
    # layer's gradient filled are stamped for the next all-reduce.
    bucket = ours.reducer.buckets[0]
    progress = ours.reducer.all_reduce._progress[bucket.buffer.data_ptr()]
    stale = bucket.handle is None and progress.begun == 0 and int((progress.mine == 1).sum())
    if rank == 1:
        time.sleep(0.5)  # (without the ranks' meeting, rank 0 would sum its blocks meanwhile)
    opt.zero_grad()
    F.cross_entropy(ours(mine_x), mine_y).backward()
    opt.step()
    reference = model()
    F.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    state = sw.full_state_dict(ours)
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return stale, diff


def test_a_backward_taken_back_late_on_one_rank_is_not_summed_by_another():
    for stale_blocks, diff in run(takes_back_in_step, 2):
        assert stale_blocks >= 8  # (of the 2.6 MB gradient's ten 256 KiB blocks)
        assert diff <= 1e-6


def test_a_peer_process_that_ended_is_told_apart_from_a_live_one():
    import os
    import subprocess
    import time

    from shardwise.comm.shared_memory import process_ended

    child = subprocess.Popen(["true"])
    deadline = time.time() + 10
    # ended, not yet reaped: a zombie
    while not process_ended(child.pid) and time.time() < deadline:
        time.sleep(0.01)
    assert process_ended(child.pid)
    assert Path(f"/proc/{child.pid}").exists()  # (still listed: it was the zombie state)
    child.wait()
    assert process_ended(child.pid)  # reaped: gone
    assert not process_ended(os.getpid())
