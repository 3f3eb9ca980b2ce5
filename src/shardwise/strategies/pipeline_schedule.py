"""The order of a pipeline stage's work in one step, and its receives, posted ahead.

`schedule_order` gives the ("F", i) / ("B", i) sequence of GPipe (all forwards, then all
backwards) or 1F1B (PipeDream-Flush: warm-up forwards, then one forward and one backward in
turn); `pipeline.py` describes both. `Inbox` posts each receive as soon as the op that needs it
is known, so a message lands while the stage computes.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import comm
from shardwise.comm.messages import read_tensor_header, recv_header


class Inbox:
    """A stage's receives in one step, each posted as soon as the next op that needs it is
    known, before the compute of the op in hand, so the transfer overlaps that compute. (A
    message sent before its receive is posted costs about a round trip more on gloo: the
    step's loss, received after the last backward, waited 0.58 ms on the MLP; posted with the
    last gradient, 0.03 ms.) One header per step gives the activations' shape (micro-batches
    are equal chunks)."""

    def __init__(self, model: Any) -> None:  # the PipelineModel
        self.model = model
        self.shape: tuple[list[int], torch.dtype] | None = None
        self.posted: dict[tuple[str, int], tuple[comm.Handle, torch.Tensor]] = {}

    def _post(self, key: tuple[str, int], buffer: torch.Tensor, src: int) -> None:
        self.posted[key] = (comm.irecv(buffer, src, self.model.group), buffer)

    def _take(self, key: tuple[str, int]) -> torch.Tensor:
        handle, buffer = self.posted.pop(key)
        handle.wait()
        return buffer

    def activation(self, i: int) -> torch.Tensor:
        model = self.model
        if self.shape is None:  # the step's first activation brings the header
            head = recv_header(model.index - 1, model.group, model.device)
            self.shape = read_tensor_header(head)
        if ("F", i) not in self.posted:
            self._post_activation(i)
        x = self._take(("F", i))
        return x.requires_grad_(x.is_floating_point())

    def _post_activation(self, i: int) -> None:
        shape, dtype = self.shape
        buffer = torch.empty(shape, dtype=dtype, device=self.model.device)
        self._post(("F", i), buffer, self.model.index - 1)

    def gradient(self, i: int, out: torch.Tensor) -> torch.Tensor:
        if ("B", i) not in self.posted:
            self._post_gradient(i, out)
        return self._take(("B", i))

    def _post_gradient(self, i: int, out: torch.Tensor) -> None:
        model = self.model
        self._post(("B", i), torch.empty_like(out), model.index + 1)
        if i == model.microbatches - 1:  # the step's loss follows this gradient: posted too
            self._post(("loss", 0), torch.empty(1, device=model.device), model.index + 1)

    def loss(self) -> torch.Tensor:
        """The step's loss, sent by the next stage right after the last micro-batch's gradient."""
        return self._take(("loss", 0)).reshape(())

    def prefetch(self, order: list[tuple], start: int, saved: dict) -> None:
        """Post the receive of the next op that needs one, if it is not posted yet."""
        model = self.model
        for op, i in order[start:]:
            if op == "F" and not model.is_first and self.shape is not None:
                if ("F", i) not in self.posted:
                    self._post_activation(i)
                return
            if op == "B" and not model.is_last and i in saved:
                if ("B", i) not in self.posted:
                    self._post_gradient(i, saved[i][1])
                return


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple]:
    """The ("F", i) / ("B", i) sequence stage `stage` runs in one step."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order
