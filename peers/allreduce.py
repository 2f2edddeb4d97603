"""Butterfly all-reduce whose result is the same bytes on every group member.

Stock hivemind returns `average - mine` to each sender, who then adds it to its own tensor: in floating
point `mine + (average - mine)` is not `average`, so members would end a round with slightly different
parameters and drift apart. Here every reducer returns the averaged part itself, serialized losslessly,
and keeps exactly those values for its own share, so all members apply identical bytes.

Weights are not taken from senders: the group agrees on them from the tickets gathered during
matchmaking (see `averager.py`), so a sender can never make itself count for more than one.
Each reducer also screens what it is sent: a part with the wrong shape or a non-finite value is dropped
(weight 0 for that part) instead of poisoning the mean.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2


class SafeDivisionReducer(TensorPartReducer):
    """A part whose every contribution was dropped averages to zeros, not 0/0 = NaN."""

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            if self.denominator > 0:
                result = self.accumulator.div_(self.denominator)
            else:
                result = self.accumulator.zero_()
            self.current_part_future.set_result(result)
            self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """All-reduce that yields averaged tensors (not deltas) with agreed, sender-independent weights."""

    tensor_part_reducer: TensorPartReducer

    def __init__(self, *, sender_weights: dict[PeerID, float], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        # A failed reducer's part then comes back as our own input (not zeros); the caller sees
        # `failed_size > 0` and knows its result is not the group's.
        self.tensor_part_container.return_deltas = False
        # The stock reducer built by super() is never used; mark it finished so it does not log on deletion.
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = SafeDivisionReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids)
        )
        self.sender_weights = [float(sender_weights.get(peer, 0.0)) for peer in self.sender_peer_ids]
        self.screened_parts = 0  # contributions this reducer dropped (wrong shape, NaN/Inf)

    @property
    def failed_size(self) -> int:
        """Elements whose average we never received (their reducer failed): our result is incomplete."""
        return int(self.tensor_part_container.failed_size)

    def _screen(self, sender_index: int, part_index: int, part: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The value and weight a sender's part enters the mean with."""
        expected = self.parts_for_local_averaging[part_index].shape
        weight = self.sender_weights[sender_index]
        if part.shape != expected or part.dtype != torch.float32 or not bool(torch.isfinite(part).all()):
            self.screened_parts += 1
            return torch.zeros(expected), 0.0
        if weight == 0.0:
            return torch.zeros(expected), 0.0
        return part, weight

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            await super()._communicate_with_peer(peer_id)  # remote reducers already send averages
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, own_part in enumerate(self.parts_for_local_averaging):
            part, weight = self._screen(sender_index, part_index, own_part)
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=weight
            )
            # Keep a private copy: the reducer's accumulator is shared with what we send to others.
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged.clone())

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        loop = asyncio.get_running_loop()
        try:
            async for message in stream:
                if part_index >= self.tensor_part_reducer.num_parts:
                    break  # a sender that keeps talking past its parts is cut off (and banned below)
                received = await loop.run_in_executor(None, _deserialize_or_none, message.tensor_part)
                part, weight = self._screen(
                    sender_index, part_index, received if received is not None else _BAD
                )
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:
                    break
                part_index += 1
                serialized = await loop.run_in_executor(None, _serialize_exact, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


_BAD = torch.full((1,), float("nan"))


def _deserialize_or_none(message: runtime_pb2.Tensor) -> torch.Tensor | None:
    try:
        return deserialize_torch_tensor(message)
    except Exception:  # a stranger's malformed tensor is screened out, not raised
        return None


def _serialize_exact(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    # NONE compression: fp32 bytes in, the same fp32 bytes out on every receiver.
    return serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)


def sender_weights_for(peers: Sequence[PeerID], weights: Sequence[float]) -> dict[PeerID, float]:
    return dict(zip(peers, weights, strict=True))
