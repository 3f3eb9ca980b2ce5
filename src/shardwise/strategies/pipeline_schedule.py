"""The order of a pipeline rank's work in one step: which micro-batch, which chunk, which pass.

An op is a tuple (kind, micro-batch, chunk): kind "F" (forward), "B" (backward; under a
zero-bubble schedule only the gradient of the chunk's input) or "W" (the gradient of the chunk's
weights, which a zero-bubble schedule defers); chunk is the rank's own chunk index (0 unless the
rank holds several, as under interleaved 1F1B). Four schedules, S ranks, M micro-batches:

- gpipe (Huang et al., 2019): all M forwards, then all M backwards. Bubble (S-1)/(M+S-1).
- 1f1b (PipeDream-Flush, Narayanan et al., 2021): S-s-1 warm-up forwards on rank s, then one
  forward and one backward in turn, then the remaining backwards. The same bubble; at most S-s
  micro-batches' activations held, whatever M is.
- interleaved (Narayanan et al., 2021, Megatron-LM): the model cut into S*v chunks, rank s
  holding chunks s, s+S, s+2S, ...; the forwards go through the rank's chunks S micro-batches at
  a time, the backwards the other way. A chunk's pass is v times shorter, so the warm-up and
  drain are too: bubble (S-1)/(v*M+S-1), for v times the messages. M must be a multiple of S.
- zb-h1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): 1F1B with each backward
  split in two. B computes only the input's gradient, which the previous rank waits for; W,
  the weights' gradient, nobody waits for, so rank s defers it by s micro-batches and does it
  where 1F1B would idle. With F, B and W of equal length the bubble is (S-1)/(3M+S-1) of the
  step, a third of 1F1B's, for the same peak memory as 1F1B on rank 0.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

Op = tuple[str, int, int]  # (kind "F"/"B"/"W", micro-batch, this rank's chunk)


def schedule_order(
    schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[Op]:
    """The ops rank `stage` of `stages` runs in one step of `microbatches` micro-batches, with
    `chunks` chunks of the model on each rank (interleaved only)."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, m)
    if schedule == "interleaved":
        return interleaved(stage, stages, m, chunks)
    if schedule == "zb-h1":
        return zb_h1(stage, stages, m)
    raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")


def one_f_one_b(stage: int, stages: int, m: int) -> list[Op]:
    warmup = min(stages - stage - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warmup, m)]


def interleaved(stage: int, stages: int, m: int, chunks: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B: forward k of the rank's M*v runs chunk (k // S) % v
    (S micro-batches per chunk in turn), backward k the chunks in reverse; the warm-up is the
    v-1 chunks' first rounds plus two ops per rank still ahead, so that the first backward's
    gradient has arrived when it runs."""
    total = m * chunks

    def microbatch(k: int) -> int:
        return (k // (stages * chunks)) * stages + k % stages

    def forward(k: int) -> Op:
        return ("F", microbatch(k), (k // stages) % chunks)

    def backward(k: int) -> Op:
        return ("B", microbatch(k), chunks - 1 - (k // stages) % chunks)

    warmup = min((chunks - 1) * stages + 2 * (stages - stage - 1), total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def zb_h1(stage: int, stages: int, m: int) -> list[Op]:
    """1F1B's forwards and input-gradient backwards, rank s doing W(i) after B(i+s): the last
    rank defers most, filling the drain's bubble, and holds no more than rank 0 does."""
    order: list[Op] = []
    deferred = 0  # weight gradients done so far
    for op in one_f_one_b(stage, stages, m):
        order.append(op)
        if op[0] == "B" and op[1] >= stage:
            order.append(("W", deferred, 0))
            deferred += 1
    return order + [("W", i, 0) for i in range(deferred, m)]


def bubble_formula(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction of a step with equal stages and free messages: (S-1)/(M+S-1) for GPipe
    and 1F1B, (S-1)/(v*M+S-1) interleaved, and ZB-H1's with F = B = W: (S-1)/(3M+S-1)."""
    s, m = stages, microbatches
    if schedule == "interleaved":
        return (s - 1) / (chunks * m + s - 1)
    if schedule == "zb-h1":
        return (s - 1) / (3 * m + s - 1)
    return (s - 1) / (m + s - 1)


def held_microbatches(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The most micro-batches' activations rank 0 holds at once, in units of a whole stage's
    (a chunk holds 1/v of them): M under GPipe, min(S, M) under 1F1B and ZB-H1 (whose W
    deferrals make every rank hold rank 0's), and interleaved's warm-up plus one, in chunks."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved":
        warmup = min((chunks - 1) * stages + 2 * (stages - 1), microbatches * chunks)
        return min(warmup + 1, microbatches * chunks) / chunks
    return min(stages, microbatches)
