"""A reducer's arithmetic for one part: every sender's copy buffered, then reduced together.

Robust reducers (median, CenteredClip) need all n copies at once, and reducing them in sender order
rather than arrival order makes the result independent of network timing. `peers/allreduce.py` runs
these reducers inside hivemind's butterfly all-reduce.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from peers.wirecodec import PartCodec, requantize

log = logging.getLogger("peers.partreduce")

PartReduce = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int]]]
"""(stacked [n, d], weights [n] ≥ 0, the largest 1) → (reduced [d], indices of senders found faulty)."""
PartCheck = Callable[[torch.Tensor, torch.Tensor, float], bool]
# What a reducer sends back for a part it reduced, given the reduced part (None: the reduced part itself).
# Honest nodes pass none: the reduced part goes back as it is.
PartReply = Callable[[torch.Tensor], torch.Tensor]
"""(averaged part received from a reducer, our own input for that part, our weight over the senders'
mean weight: 1 at equal weights, 0.1 if we carry a tenth of the typical tokens) → plausible?"""


def own_share(weights: list[float], own: float) -> float:
    """``own`` over the mean positive weight in ``weights`` (1.0 when there is nothing to compare)."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return 1.0
    return own / (sum(positive) / len(positive))


def weighted_mean(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The default reduction: Σ w·x / Σ w over the included rows (w > 0), summed in sender order in float64
    (deterministic; with equal weights of 1 exactly the plain mean)."""
    total = torch.zeros(stacked.shape[1], dtype=torch.float64)
    count = 0.0
    for row, weight in zip(stacked, weights.tolist()):
        if weight > 0:
            total.add_(row.to(torch.float64), alpha=weight)
            count += weight
    result = total / count if count > 0 else total
    return result.to(torch.float32), []


class BufferingReducer(TensorPartReducer):
    """Collects every sender's copy of a part, then reduces them together with `reduce_part`.

    Robust reducers (median, CenteredClip) need all n copies at once, and summing them in sender
    order rather than arrival order makes the result independent of network timing.
    """

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        reduce_part: PartReduce,
        codec: PartCodec | None = None,
    ) -> None:
        self.reduce_part = reduce_part
        self.codec = codec
        self.faulty_senders: set[int] = set()
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        # With a codec: the encoded result of each part, sent as is to every sender of the part.
        self.payloads: dict[int, bytes] = {}
        # Each part's rows as reduced, (sender index, weight) in sender order: what a relaying reducer
        # tells its senders (peers/partrelay.py).
        self.rows: dict[int, list[tuple[int, float]]] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self.contributions = {}
        super().reset_accumulators()
        self.accumulator = None  # unused: contributions are buffered instead

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"part {part_index} arrived after the reducer finished")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.contributions[sender_index] = (tensor_part, weight)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        shape = self.part_shapes[self.current_part_index]
        order = sorted(self.contributions)
        self.rows[self.current_part_index] = [(i, self.contributions[i][1]) for i in order]
        if order:
            stacked = torch.stack([self.contributions[i][0].reshape(-1) for i in order])
            weights = torch.tensor([self.contributions[i][1] for i in order], dtype=torch.float32)
            reduced, faulty = self.reduce_part(stacked, weights)
            if faulty:  # the evidence, in the log, for the ban that follows (a false one must be traceable)
                log.warning(
                    "part %d: sender(s) %s dropped as faulty; every sender's (index, weight, norm): %s",
                    self.current_part_index,
                    [order[i] for i in faulty],
                    _row_summary(order, stacked, weights),
                )
            self.faulty_senders.update(order[i] for i in faulty)
            result = reduced.reshape(shape).to(torch.float32)
        else:
            result = torch.zeros(shape)
        if self.codec is not None:
            # Encoded once; the reducer keeps what its payload decodes to, as every receiver will.
            result, self.payloads[self.current_part_index] = requantize(self.codec, result)
        self.current_part_future.set_result(result)
        self.reset_accumulators()


def _row_summary(order: Sequence[int], stacked: torch.Tensor, weights: torch.Tensor) -> str:
    norms = torch.linalg.vector_norm(stacked.to(torch.float64), dim=1).tolist()
    return ", ".join(
        f"({i}, {w:.3g}, {n:.3g})" for i, w, n in zip(order, weights.tolist(), norms, strict=True)
    )
