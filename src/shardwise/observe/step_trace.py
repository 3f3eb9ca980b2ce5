"""A trace of a few steps (`train.trace_steps: [first, last]`): every phase and collective of
every rank on one time axis, the clocks' offsets measured before and after, merged by rank 0
into RUN_DIR/trace.json (chrome://tracing, Perfetto)."""

from __future__ import annotations

from pathlib import Path

from shardwise import comm
from shardwise.observe.clock import measure_offset
from shardwise.observe.phases import PhaseTimer
from shardwise.observe.timeline import Timeline, merge


class StepTrace:
    """Records steps `first`..`last` of this rank into its timeline."""

    def __init__(
        self, timeline: Timeline, steps: tuple[int, int], out: Path, rt, phases: PhaseTimer
    ) -> None:
        self.timeline, self.out, self.rt, self.phases = timeline, out, rt, phases
        self.first, self.last = steps

    def before_step(self, step: int) -> None:
        if step == self.first:
            self._start()

    def after_step(self, step: int, steps: int) -> None:
        if step == min(self.last, steps):
            self._end()

    def _start(self) -> None:
        """Measure the clocks' offsets, then record every phase and collective."""
        timeline = self.timeline
        timeline.offsets.append(measure_offset(self.rt.device, timeline.clock))
        comm.stats.end_step()  # the clocks' messages are not the step's
        timeline.recording = True
        self.phases.timeline, comm.stats.listener = timeline, timeline.collective

    def _end(self) -> None:
        """Stop recording, measure the offsets again (the clocks drift), write this rank's
        events; rank 0 merges every rank's into RUN_DIR/trace.json."""
        timeline = self.timeline
        timeline.recording = False
        self.phases.timeline = comm.stats.listener = None
        timeline.offsets.append(measure_offset(self.rt.device, timeline.clock))
        files = [self.out / "trace" / f"rank{r}.json" for r in range(self.rt.world_size)]
        timeline.write(files[self.rt.rank])
        comm.barrier()  # every rank's file is complete
        comm.stats.end_step()
        if self.rt.is_main:
            merged = merge(files, self.out / "trace.json")
            bounds = ", ".join(
                f"rank {r}: {1e3 * o[0]['offset_s']:+.3f} ms +- {1e3 * o[0]['error_s']:.3f}"
                for r, o in merged["otherData"]["offsets_to_rank0"].items()
            )
            print(f"shardwise: timeline in {self.out / 'trace.json'} (clock offsets {bounds})")
