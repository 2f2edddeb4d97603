"""Butterfly all-reduce whose result is the same bytes on every group member.

Stock hivemind returns `average - mine` to each sender, who then adds it to its own tensor: in floating
point `mine + (average - mine)` is not `average`, so members would end a round with slightly different
parameters and drift apart. Here every reducer returns the averaged part itself, serialized losslessly,
and keeps exactly those values for its own share, so all members apply identical bytes.

Weights are not taken from senders' messages: the group agrees on them from the tickets gathered during
matchmaking (the tokens behind each contribution, capped: see `membership.py`), so a sender can never
make itself count for more than its ticket allows.
Each reducer also screens what it is sent: a part with the wrong shape or a non-finite value is dropped
(weight 0 for that part) instead of poisoning the mean.

With a `PartCodec` (the run's `averaging.compression`), parts travel encoded: each sender encodes each
part it sends (its own share too, so every contribution went through the same codec), the reducer decodes
every copy — a payload that does not decode is screened like a non-finite part — reduces the decoded
values, encodes the result once and sends those bytes back; every member, the reducer included, keeps
decode(encode(result)), so all apply identical values. A sparse codec's parts are relayed instead
(`peers/partrelay.py`): each reducer forwards its part's payloads with the coefficient it gave each, and every
member combines them itself, to the same bits.
Parts hold `part_size_bytes / 4` elements whatever
the codec, so part boundaries sit at fixed offsets of each tensor; when the codec's blocks divide that
size, encoding part by part gives exactly what encoding each whole tensor would (which is what lets a
sender keep its error-feedback residual without knowing the split).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import cast

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES,
    AllreduceException,
    BannedException,
    TensorPartReducer,
)
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import attach_event_on_finished

from peers.partreduce import BufferingReducer, PartCheck, PartReduce, PartReply, own_share, weighted_mean
from peers.partrelay import PartRelay, PartWeigh, relays
from peers.wirecodec import (
    CodecCompression,
    PartCodec,
    decode_message,
    decode_payload_tensor,
    encode_or_empty,
    payload_message,
)

# How long a reducer keeps a sender's stream open after its last average, waiting for the sender to close it
# (see `ExactAllReduceRunner.rpc_aggregate_part`): a sender closes it as soon as that average is in, so this
# bound only matters for a sender that died or hangs.
LINGER_SECONDS = 30.0

log = logging.getLogger("peers.allreduce")


class ExactAllReduceRunner(AllReduceRunner):
    """All-reduce that yields averaged tensors (not deltas) with agreed, sender-independent weights."""

    tensor_part_reducer: TensorPartReducer

    def __init__(
        self,
        *,
        sender_weights: dict[PeerID, float],
        reduce_part: PartReduce | None = None,
        check_part: PartCheck | None = None,
        codec: PartCodec | None = None,
        reply_part: PartReply | None = None,
        weigh_part: PartWeigh | None = None,
        **kwargs: object,
    ) -> None:
        if codec is not None:
            # Parts of fp32 tensors hold part_size_bytes / 4 elements (the ratio reported is 1): a codec
            # block must never straddle two parts, or encoding by parts would differ from encoding tensors.
            part_size_bytes = kwargs.get("part_size_bytes", DEFAULT_PART_SIZE_BYTES)
            assert isinstance(part_size_bytes, int)
            part_size = int(part_size_bytes / 4)  # as TensorPartContainer computes it
            if part_size % codec.alignment:
                raise ValueError(
                    f"codec blocks of {codec.alignment} do not divide parts of {part_size} elements"
                )
            kwargs["compression"] = CodecCompression(codec)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.codec = codec
        # A failed reducer's part then comes back as our own input (not zeros); the caller sees
        # `failed_size > 0` and knows its result is not the group's.
        self.tensor_part_container.return_deltas = False
        # The stock reducer built by super() is never used; mark it finished so it does not log on deletion.
        self.tensor_part_reducer.finished.set()
        # Relaying (a sparse codec): our parts' payloads and coefficients, for the replies.
        self._relay = (
            PartRelay(codec, len(self.sender_peer_ids), weigh_part)
            if codec is not None and relays(codec)
            else None
        )
        relaying = self._relay is not None
        self.tensor_part_reducer = BufferingReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            self._weigh_and_combine if relaying else reduce_part or weighted_mean,
            None if relaying else codec,  # relayed parts are never re-encoded: members combine them alike
        )
        self.sender_weights = [float(sender_weights.get(peer, 0.0)) for peer in self.sender_peer_ids]
        # Contributions this reducer dropped (wrong shape, NaN/Inf, a payload that does not decode).
        self.screened_parts = 0
        self.screened_senders: set[int] = set()
        self.check_part = check_part
        self.own_share = own_share(self.sender_weights, float(sender_weights.get(self.peer_id, 0.0)))
        self.reply_part = reply_part  # what we send back for a part we reduced (None: the part)
        self.rejected_reducers: set[PeerID] = set()
        # Why a reducer's averages never (all) arrived, by reducer: hivemind only logs this at debug level,
        # and "incomplete" alone does not tell a dead peer from a refused stream.
        self.reducer_errors: dict[PeerID, str] = {}
        # Tensor payload bytes on the wire this round (serialized parts and averages, both directions):
        # what the messages' tensor buffers actually held, encoded or not.
        self.bytes_sent = 0
        self.bytes_received = 0
        # Senders we are still replying to: our own averages can all be in while our last reply to another
        # sender is being encoded, and a round's bytes are read once it is done (`replies_counted`).
        self._owed: set[int] = set()  # sender indices
        self._replies_done = asyncio.Event()
        self._replies_done.set()
        # Our own input for every part, by reducer: what a returned average is checked against.
        self._own_inputs = [
            tuple(part for part, _ in parts) for parts in self.tensor_part_container._input_parts_by_peer
        ]
        container = self.tensor_part_container
        self._failed_reducers: set[int] = set()
        register = container.register_processed_part
        container.register_processed_part = self._checked(register)  # type: ignore[method-assign]
        register_failed = container.register_failed_reducer
        container.register_failed_reducer = self._on_failed_reducer(register_failed)  # type: ignore[method-assign]

    def _on_failed_reducer(self, register_failed: Callable[[int], None]) -> Callable[[int], None]:
        """A vanished reducer's parts are filled with our own inputs: nothing was received, nothing to check."""

        def failed(peer_index: int) -> None:
            self._failed_reducers.add(peer_index)
            register_failed(peer_index)

        return failed

    def _checked(
        self, register: Callable[[int, int, torch.Tensor], None]
    ) -> Callable[[int, int, torch.Tensor], None]:
        """Wrap the container's intake so every average from another reducer is decoded and checked first."""

        def checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if peer_index in self._failed_reducers:  # our own input, standing in for a vanished reducer
                register(peer_index, part_index, part)
                return
            remote = self.ordered_peer_ids[peer_index] != self.peer_id
            own = self._own_inputs[peer_index][part_index]
            received: torch.Tensor | None = part
            if remote:
                self.bytes_received += part.numel() * part.element_size()  # the message's tensor buffer
                if self._relay is not None:
                    receiver = self.sender_peer_ids.index(self.peer_id)
                    received = self._relay.combined(
                        part, receiver=receiver, own=own, weights=self.sender_weights
                    )
                elif self.codec is not None:  # our own reductions arrive decoded already
                    received = decode_payload_tensor(self.codec, part, own.numel())
                if self.codec is not None:
                    received = None if received is None else received.reshape(own.shape)
            # Our own reductions are checked too: in a group of two, statistics cannot outvote a liar.
            plausible = (
                received is not None and received.shape == own.shape and received.dtype == torch.float32
            )
            if plausible and self.check_part is not None:
                assert received is not None
                plausible = self.check_part(received, own, self.own_share)
            if not plausible or received is None:
                # The safe value every honest member falls back to: no update for these coordinates.
                if remote:
                    self.rejected_reducers.add(self.ordered_peer_ids[peer_index])
                received = torch.zeros_like(own)
            register(peer_index, part_index, received)

        return checked

    def _weigh_and_combine(
        self, stacked: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """A relayed part's reduction at its reducer (`PartRelay`)."""
        assert self._relay is not None
        reducer = self.tensor_part_reducer
        senders = sorted(reducer.contributions)  # type: ignore[attr-defined]  # the rows' order
        return self._relay.weigh_and_combine(reducer.current_part_index, senders, stacked, weights)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(message.tensor_part.buffer)
            yield message

    @property
    def faulty_senders(self) -> set[PeerID]:
        """Senders whose contribution this reducer dropped (screened or found faulty by the reducer)."""
        indices = self.screened_senders | self.tensor_part_reducer.faulty_senders  # type: ignore[attr-defined]
        return {self.sender_peer_ids[i] for i in indices}

    @property
    def failed_size(self) -> int:
        """Elements whose average we never received (their reducer failed): our result is incomplete."""
        return int(self.tensor_part_container.failed_size)

    def _screen(self, sender_index: int, part_index: int, part: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The value and weight a sender's part enters the mean with."""
        expected = self.parts_for_local_averaging[part_index].shape
        weight = self.sender_weights[sender_index]
        if part.shape != expected or part.dtype != torch.float32 or not bool(torch.isfinite(part).all()):
            why = "did not decode" if part.shape != expected else "holds NaN/Inf"
            log.warning(
                "part %d from %s %s: screened out", part_index, self.sender_peer_ids[sender_index], why
            )
            self.screened_parts += 1
            self.screened_senders.add(sender_index)
            return torch.zeros(expected), 0.0
        if weight == 0.0:
            return torch.zeros(expected), 0.0
        return part, weight

    def _contribution(self, message: runtime_pb2.Tensor, part_index: int) -> torch.Tensor:
        """A sender's copy of one of our parts, as values; `_BAD` (screened out) if it does not decode."""
        if self.codec is None:
            received = _deserialize_or_none(message)
        else:
            expected = self.parts_for_local_averaging[part_index].shape
            received = decode_message(self.codec, message, expected.numel())
            received = None if received is None else received.reshape(expected)
        return received if received is not None else _BAD

    def _own_contribution(self, part: torch.Tensor, part_index: int) -> torch.Tensor:
        """decode(encode(our part)), exactly what any other reducer would have made of what we send it."""
        assert self.codec is not None
        payload = encode_or_empty(self.codec, part)
        if self._relay is not None:
            self._relay.keep(part_index, self.sender_peer_ids.index(self.peer_id), payload)
        return self._contribution(payload_message(payload), part_index)

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            try:
                await self._exchange_with_reducer(peer_id)
            except Exception as e:  # the reducer is already marked failed; keep the reason for the outcome
                self.reducer_errors[peer_id] = short_reason(e)
                raise
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_running_loop()
        for part_index, own_part in enumerate(self.parts_for_local_averaging):
            if self.codec is not None:  # our own copy goes through the codec like everybody else's
                own_part = await loop.run_in_executor(None, self._own_contribution, own_part, part_index)
            part, weight = self._screen(sender_index, part_index, own_part)
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=weight
            )
            # Keep a private copy: the reducer's accumulator is shared with what we send to others.
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged.clone())

    async def _exchange_with_reducer(self, peer_id: PeerID) -> None:
        """Send a remote reducer our parts and take its averages: hivemind's exchange (hivemind 1.1.12,
        averaging/allreduce.py:212-245), except that we close the stream as soon as the last average is in.

        The receiving side must close first. When the reducer closed its end right after its last reply
        (hivemind's `_handle_stream`, p2p/p2p_daemon.py:469-471, then `closing(writer)` at :461), its p2pd closed the
        libp2p stream both ways (go-libp2p-daemon's `doStreamPipe`: `dst.Close()` on one copy, `s.Reset()`
        when the other copy's read fails), and a reset makes our p2pd drop whatever of that reply it still
        held: we read a clean end of stream mid-message, which hivemind's client takes for the end
        (p2p/p2p_daemon.py:502-503), and the round failed with "sent 3 parts, but we expected 4" (issue 15).
        """
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
        stream = cast(
            AsyncGenerator[averaging_pb2.AveragingData, None],
            await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs),
        )
        loop = asyncio.get_running_loop()
        try:
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            for part_index in range(expected):
                try:
                    message = await asyncio.wait_for(anext(stream), self.reducer_timeout)
                except StopAsyncIteration:
                    raise AllreduceException(
                        f"peer {peer_id} sent {part_index} parts, but we expected {expected}"
                    ) from None
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                averaged = await loop.run_in_executor(None, deserialize_torch_tensor, message.tensor_part)
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            await stream.aclose()  # we have all we need: the reducer may close its end now

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's reducer side, then keep the stream open until the sender closes it (see
        `_exchange_with_reducer`): our last reply must reach the sender before our end of the stream closes."""
        async for message in super().rpc_aggregate_part(stream, context):
            yield message
        await _until_sender_closes(stream)

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        loop = asyncio.get_running_loop()
        self._owed.add(sender_index)
        self._replies_done.clear()
        try:
            async for message in stream:
                if part_index >= self.tensor_part_reducer.num_parts:
                    break  # a sender that keeps talking past its parts is cut off (and banned below)
                self.bytes_received += len(message.tensor_part.buffer)
                received = await loop.run_in_executor(
                    None, self._contribution, message.tensor_part, part_index
                )
                if self._relay is not None:
                    self._relay.keep(part_index, sender_index, bytes(message.tensor_part.buffer))
                part, weight = self._screen(sender_index, part_index, received)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, self._reply, averaged, part_index, sender_index)
                part_index += 1
                self.bytes_sent += len(serialized.buffer)
                if part_index == self.tensor_part_reducer.num_parts:
                    self._replied(sender_index)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            self._replied(sender_index)
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _replied(self, sender_index: int) -> None:
        """This sender's replies are all counted (or it is gone); idempotent."""
        self._owed.discard(sender_index)
        if not self._owed:
            self._replies_done.set()

    async def replies_counted(self, timeout: float) -> None:
        """Wait, at most `timeout` s, until every reply we owe another sender is counted in `bytes_sent`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._replies_done.wait(), timeout)

    def _reply(self, averaged: torch.Tensor, part_index: int, sender_index: int) -> runtime_pb2.Tensor:
        """What we send back for one of our parts: the result's exact fp32 bytes, its codec payload, or (relayed)
        the other senders' payloads."""
        if self._relay is not None:
            senders = [s for s, _ in self.tensor_part_reducer.rows[part_index]]  # type: ignore[attr-defined]
            lie = (
                None
                if self.reply_part is None
                else encode_or_empty(self._relay.codec, self.reply_part(averaged))
            )
            return payload_message(self._relay.reply(part_index, senders, sender_index, lie))
        if self.reply_part is not None:
            averaged = self.reply_part(averaged)
        elif self.codec is not None:  # the payload encoded as the part was reduced
            return payload_message(self.tensor_part_reducer.payloads[part_index])  # type: ignore[attr-defined]
        if self.codec is None:
            return _serialize_exact(averaged)
        return payload_message(encode_or_empty(self.codec, averaged))


async def _until_sender_closes(stream: AsyncIterator[averaging_pb2.AveragingData]) -> None:
    """Wait, at most LINGER_SECONDS, until hivemind cancels this handler: it does when the sender's end of
    the stream closes (p2p/p2p_daemon.py:475-477, 481-482). Whatever the sender still sends is read and dropped, so
    that hivemind's request queue (5 deep, p2p/p2p_daemon.py:437) never blocks the loop that sees the close.
    """
    with contextlib.suppress(Exception):  # the timeout, or a request stream that already failed
        async with asyncio.timeout(LINGER_SECONDS):
            async for _ in stream:
                pass
            await asyncio.Event().wait()


_BAD = torch.full((1,), float("nan"))


def short_reason(error: BaseException, limit: int = 160) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    text = " ".join(text.split())  # one log line, whatever the exception's message holds
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _deserialize_or_none(message: runtime_pb2.Tensor) -> torch.Tensor | None:
    try:
        return deserialize_torch_tensor(message)
    except Exception:  # a stranger's malformed tensor is screened out, not raised
        return None


def _serialize_exact(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    # NONE compression: fp32 bytes in, the same fp32 bytes out on every receiver.
    return serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)
