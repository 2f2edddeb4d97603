"""Relayed parts: with a sparse codec every member combines the senders' payloads itself; the reducer of a part
forwards them, with the coefficient it gave each, instead of the reduced part.

Why: a reduced part of top-k payloads holds the union of the senders' supports, up to n times denser than
any of them, so sending it back costs more than the payloads that made it. Relayed, a member uploads its
share of parts once ((n − 1)/n of its payload) and, as a reducer, the other senders' payloads of its part
to each of them ((n − 1)²/n): (n − 1) payloads in all, what an all-gather costs, through the same reducers
(private peers, auxiliary reducers and relays included) and the same streams as every other codec.

The reducer decides (`PartWeigh`: screening, clipping, the weights) and every member, the reducer too,
combines: Σ coefficientᵢ · rowᵢ in float64, row by row in sender order, each product and each sum its own
correctly rounded operation (`combine`). That is bit-identical on every CPU, where a norm or a fused
multiply-add is not (their rounding follows the vector width), so members on different machines end with
the same θ_global.

A reducer's reply for one part, to one sender, is:

    n status bytes, one per sender in sender order: ABSENT (not among the reducer's rows: it failed or was
        banned before this part), ZERO (a row of coefficient 0: screened, or weight 0 by the tickets),
        PAYLOAD (its payload is a row, with a coefficient > 0);
    n little-endian float64 coefficients, one per sender (0 unless PAYLOAD);
    then the payloads of every PAYLOAD sender in sender order but the receiver's own (it holds its own),
        each exactly `codec.encoded_size(numel)` bytes.

A reply that does not parse, a payload in it that does not decode, or a coefficient outside what an honest
weighing can give (negative, non-finite, above the sender's share of the weight) makes the part implausible
at the receiver (as a wrong average would).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence

import torch

from peers.wirecodec import PartCodec, encode_or_empty

ABSENT, ZERO, PAYLOAD = 0, 1, 2
_COEF = struct.Struct("<d")
# A coefficient may exceed its sender's share of the weight by this much: the reducer weighs float32 weights
SHARE_SLACK = 1e-6

PartWeigh = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int]]]
"""(stacked [n, d] decoded rows, weights [n] ≥ 0) → (each row's coefficient, float64 [n], ≥ 0; indices of
rows found faulty). The relayed part is Σ coefficientᵢ · rowᵢ (`combine`)."""


def relays(codec: PartCodec | None) -> bool:
    """Whether parts in `codec` are relayed (a sparse codec says so) rather than reduced by their reducer."""
    return codec is not None and bool(getattr(codec, "relays_parts", False))


def mean_weigh(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The undefended weighing: wᵢ / Σ w (the weighted mean), nobody faulty."""
    w = weights.to(torch.float64)
    total = float(w.sum())
    return (w / total if total > 0 else torch.zeros_like(w)), []


def combine(stacked: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """Σ coefficientᵢ · rowᵢ (float32 [d]): float64, row 0 first, one rounding per product and per sum, rows
    with coefficient 0 skipped (a screened row may hold NaN). The same bits on every machine."""
    total = torch.zeros(stacked.shape[1], dtype=torch.float64)
    for row, coefficient in zip(stacked, coefficients, strict=True):
        if coefficient != 0.0:
            total.add_(torch.mul(row.to(torch.float64), coefficient))
    return total.to(torch.float32)


def statuses(rows: Sequence[int], coefficients: Sequence[float]) -> list[int]:
    """Each sender's status from the senders a reducer reduced (`rows`) and its coefficients (by sender): a row
    that weighs nothing (screened, or weight 0 by the tickets) is ZERO and its payload is not relayed."""
    out = [ABSENT] * len(coefficients)
    for sender in rows:
        out[sender] = PAYLOAD if coefficients[sender] > 0 else ZERO
    return out


def pack_reply(
    status: Sequence[int], coefficients: Sequence[float], payloads: Mapping[int, bytes], receiver: int
) -> bytes:
    """The reply to `receiver`: statuses, coefficients, then every PAYLOAD sender's payload but its own."""
    head = bytes(status) + b"".join(_COEF.pack(float(c)) for c in coefficients)
    return head + b"".join(payloads[s] for s, st in enumerate(status) if st == PAYLOAD and s != receiver)


def unpack_reply(
    reply: bytes, *, receiver: int, own_payload: bytes, codec: PartCodec, numel: int, weights: Sequence[float]
) -> torch.Tensor | None:
    """The part the reducer relayed, combined here (float32 [numel]); None if the reply is malformed in any
    way. `weights` are the agreed ones, in sender order."""
    n = len(weights)
    head = n + n * _COEF.size
    if len(reply) < head or any(st not in (ABSENT, ZERO, PAYLOAD) for st in reply[:n]):
        return None
    status = list(reply[:n])
    coefficients = [_COEF.unpack_from(reply, n + i * _COEF.size)[0] for i in range(n)]
    if not _plausible(status, coefficients, weights):
        return None
    size = codec.encoded_size(numel)
    forwarded = [s for s, st in enumerate(status) if st == PAYLOAD and s != receiver]
    if len(reply) != head + len(forwarded) * size:
        return None
    payloads = {s: reply[head + i * size : head + (i + 1) * size] for i, s in enumerate(forwarded)}
    if status[receiver] == PAYLOAD:
        payloads[receiver] = own_payload
    rows, used = [], []
    for sender in sorted(payloads):
        try:
            rows.append(codec.decode(payloads[sender], numel))
        except Exception:  # a payload the reducer should have screened: it lied
            return None
        used.append(coefficients[sender])
    if not rows:
        return torch.zeros(numel)
    return combine(torch.stack(rows), used)


def _plausible(status: Sequence[int], coefficients: Sequence[float], weights: Sequence[float]) -> bool:
    """What an honest weighing can give: payloads only from senders with weight, coefficients finite, > 0 on
    the payloads and 0 off them, none above its sender's share of the payloads' weight."""
    total = sum(w for w, st in zip(weights, status, strict=True) if st == PAYLOAD)
    for st, c, w in zip(status, coefficients, weights, strict=True):
        if st != PAYLOAD:
            if c != 0.0:
                return False
        elif w <= 0 or not 0.0 < c <= w / total * (1 + SHARE_SLACK):
            return False
    return True


class PartRelay:
    """A reducer's side of relaying, for one all-reduce: the payloads of its parts as they arrive, the
    coefficients it weighed each part with, and the replies it builds from them."""

    def __init__(self, codec: PartCodec, num_senders: int, weigh_part: PartWeigh | None) -> None:
        self.codec = codec
        self.num_senders = num_senders
        self.weigh_part = weigh_part or mean_weigh
        self.payloads: dict[tuple[int, int], bytes] = {}  # (part, sender) → payload, until the round ends
        self.coefficients: dict[int, list[float]] = {}  # part → each sender's coefficient

    def keep(self, part_index: int, sender_index: int, payload: bytes) -> None:
        self.payloads[(part_index, sender_index)] = payload

    def weigh_and_combine(
        self, part_index: int, senders: Sequence[int], stacked: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """The part's rows (of `senders`, in order) weighed, the coefficients kept for the replies, and the
        combination every member will compute; with the rows found faulty."""
        coefficients, faulty = self.weigh_part(stacked, weights)
        found = [float(c) for c in coefficients.tolist()]
        by_sender = [0.0] * self.num_senders
        for sender, coefficient in zip(senders, found, strict=True):
            by_sender[sender] = coefficient
        self.coefficients[part_index] = by_sender
        return combine(stacked, found), faulty

    def reply(
        self, part_index: int, senders: Sequence[int], receiver: int, lie: bytes | None = None
    ) -> bytes:
        """The reply to `receiver` for a part reduced from `senders`' rows; `lie` (a lying reducer's payload)
        in place of every relayed one."""
        coefficients = self.coefficients[part_index]
        status = statuses(senders, coefficients)
        relayed = [s for s in senders if status[s] == PAYLOAD]
        payloads = {s: lie if lie is not None else self.payloads[(part_index, s)] for s in relayed}
        return pack_reply(status, coefficients, payloads, receiver)

    def combined(
        self, reply: torch.Tensor, *, receiver: int, own: torch.Tensor, weights: Sequence[float]
    ) -> torch.Tensor | None:
        """A part another reducer relayed to us (`receiver`), combined here: hivemind hands its reply over as
        a uint8 tensor; `own` is our input for that part, whose payload we sent (the encoder is deterministic)."""
        if reply.dtype != torch.uint8 or reply.dim() != 1:
            return None
        return unpack_reply(
            reply.contiguous().numpy().tobytes(),
            receiver=receiver,
            own_payload=encode_or_empty(self.codec, own),
            codec=self.codec,
            numel=own.numel(),
            weights=weights,
        )
