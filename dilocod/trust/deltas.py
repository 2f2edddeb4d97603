"""A contributor's last few pseudo-gradients, kept encoded to be served to the peers that score them, and the
scorer's side: asking for one and decoding it (protocol: proto/deltas.py, docs/protocol.md).

What is kept is what went on the wire (an adversary's lie included), as one flat int4 payload: ~1/8 of
fp32, whatever the run's codec. Bounded: `KEEP_ROUNDS` rounds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from dilocod.codecs import CodecError
from dilocod.codecs.quant import make_codec
from proto import ProtoError
from proto.deltas import (
    PART_BYTES,
    decode_delta_reply,
    decode_delta_request,
    encode_delta_reply,
    encode_delta_request,
)

PROTOCOL = "/dilocod/delta/1.0.0"
KEEP_ROUNDS = 4  # a scorer asks right after the round; a few more cover a slow one
CODEC = "int4"
MAX_REQUEST = 128


@dataclass(frozen=True)
class Kept:
    step: int
    payload: bytes
    numel: int
    indices: list[int] | None
    tokens: int
    chunks: list[int]  # flat (epoch, chunk, lo, hi) groups


@dataclass(frozen=True)
class Fetched:
    """A contributor's Δ as the scorer decoded it, with what its reply says the Δ covers."""

    step: int
    delta: list[torch.Tensor]
    indices: list[int] | None
    tokens: int
    parts: list[tuple[int, int, int, int]]
    bytes: int


class DeltaStore:
    """Thread-safe: kept from the event loop's worker threads, served from the event loop."""

    def __init__(self, keep_rounds: int = KEEP_ROUNDS) -> None:
        self.keep_rounds = keep_rounds
        self.codec = make_codec(CODEC)
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._lock = threading.Lock()

    def keep(
        self,
        step: int,
        sent: Sequence[torch.Tensor],
        indices: list[int] | None,
        tokens: int,
        chunks: list[int],
    ) -> None:
        """Encode and keep the Δ sent at `step` (torch work: call it off the event loop)."""
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in sent]) if sent else torch.zeros(0)
        try:
            payload = self.codec.encode(flat.contiguous())
        except CodecError:  # a non-finite Δ (the `nan` adversary): nothing worth scoring is served
            return
        with self._lock:
            self._kept[step] = Kept(step, payload, flat.numel(), indices, tokens, chunks)
            while len(self._kept) > self.keep_rounds:
                self._kept.popitem(last=False)

    def steps(self) -> list[int]:
        with self._lock:
            return list(self._kept)

    def own(
        self, step: int, shapes: Sequence[torch.Size]
    ) -> tuple[list[torch.Tensor], list[int] | None] | None:
        """The Δ we sent at `step`, decoded as a scorer decodes a fetched one (the reference a scorer compares
        others with), and the tensors it covers; None when none is kept or it does not fit `shapes`."""
        with self._lock:
            kept = self._kept.get(step)
        if kept is None:
            return None
        try:
            wanted = _wanted(kept.numel, kept.indices, shapes)
            return _unflatten(self.codec.decode(kept.payload, kept.numel), wanted), kept.indices
        except (ValueError, CodecError):
            return None

    async def handle(self, _peer: str, request: bytes) -> bytes:
        """Answer one request (peers/unary.py calls it with the requester's peer id)."""
        try:
            asked = decode_delta_request(request)
        except ProtoError as e:
            return encode_delta_reply({"error": str(e)[:200]})
        with self._lock:
            kept = self._kept.get(asked["outer_step"])
        if kept is None:
            return encode_delta_reply({"error": f"no Δ kept for outer step {asked['outer_step']}"})
        parts = max(1, -(-len(kept.payload) // PART_BYTES))
        part = asked["part"]
        if part >= parts:
            return encode_delta_reply({"error": f"part {part} of {parts}"})
        reply = {
            "outer_step": kept.step,
            "codec": CODEC,
            "numel": kept.numel,
            "parts": parts,
            "part": part,
            "payload": kept.payload[part * PART_BYTES : (part + 1) * PART_BYTES],
            "indices": kept.indices,
            "tokens": kept.tokens,
            "chunks": kept.chunks or None,
        }
        return encode_delta_reply(reply)


Ask = Callable[[bytes], Awaitable[bytes]]  # one request to the contributor, its raw reply


async def fetch_delta(ask: Ask, step: int, shapes: Sequence[torch.Size]) -> Fetched:
    """The contributor's Δ at `step`, decoded to the shapes of θ_global's tensors it covers. Raises
    ValueError (a ProtoError or CodecError included) with a one-line reason when it cannot be had."""
    first = decode_delta_reply(await ask(encode_delta_request({"outer_step": step, "part": 0})))
    if first.get("error"):
        raise ValueError(f"the contributor says: {first['error']}")
    if first["outer_step"] != step:
        raise ValueError(f"asked for outer step {step}, got {first['outer_step']}")
    payloads, received = [first["payload"]], len(first["payload"])
    for part in range(1, first["parts"]):
        reply = decode_delta_reply(await ask(encode_delta_request({"outer_step": step, "part": part})))
        if reply.get("error") or reply["part"] != part or reply["numel"] != first["numel"]:
            raise ValueError(f"part {part}: {reply.get('error') or 'does not match part 0'}")
        payloads.append(reply["payload"])
        received += len(reply["payload"])
    indices = first.get("indices")
    wanted = _wanted(first["numel"], indices, shapes)  # before decoding: a lie about the size costs nothing
    delta = _unflatten(make_codec(CODEC).decode(b"".join(payloads), first["numel"]), wanted)
    chunks = first.get("chunks") or []
    parts = [tuple(chunks[i : i + 4]) for i in range(0, len(chunks), 4)]
    return Fetched(step, delta, indices, first["tokens"], parts, received)  # type: ignore[arg-type]


def _wanted(numel: int, indices: list[int] | None, shapes: Sequence[torch.Size]) -> list[torch.Size]:
    """The shapes of θ_global's tensors a Δ of `numel` elements over `indices` covers, or ValueError."""
    if indices is not None and any(not 0 <= i < len(shapes) for i in indices):
        raise ValueError("the Δ names tensors θ_global does not have")
    wanted = (
        [torch.Size(shapes[i]) for i in indices] if indices is not None else [torch.Size(s) for s in shapes]
    )
    total = sum(int(s.numel()) for s in wanted)
    if total != numel:
        raise ValueError(f"the Δ has {numel} elements, θ_global's tensors {total}")
    return wanted


def _unflatten(flat: torch.Tensor, wanted: list[torch.Size]) -> list[torch.Tensor]:
    """A flat decoded Δ cut into the shapes of the tensors it covers."""
    delta, at = [], 0
    for shape in wanted:
        n = int(shape.numel())
        delta.append(flat[at : at + n].reshape(shape))
        at += n
    return delta
