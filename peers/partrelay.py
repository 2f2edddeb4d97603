"""Relayed parts: with a sparse codec every member combines the senders' payloads itself; the reducer of a part
forwards them instead of reducing.

Why: a reduced part of top-k payloads holds the union of the senders' supports, up to n times denser than
any of them, so sending it back costs more than the payloads that made it. Relayed, a member uploads its
share of parts once ((n − 1)/n of its payload) and, as a reducer, the other senders' payloads of its part
to each of them ((n − 1)²/n): (n − 1) payloads in all, what an all-gather costs, through the same reducers
(private peers, auxiliary reducers and relays included) and the same streams as every other codec.

A reducer's reply for one part, to one sender, is:

    n status bytes, one per sender in sender order: ABSENT (not among the reducer's rows: it failed or was
        banned before this part), ZERO (a row of zeros with weight 0: screened, or weight 0 by the tickets),
        PAYLOAD (its payload is a row, with the weight the tickets give it);
    then the payloads of every PAYLOAD sender in sender order but the receiver's own (it holds its own),
        each exactly `codec.encoded_size(numel)` bytes.

Every member then decodes the same bytes into the same rows with the same weights, in the reducer's order, and
runs the same reduction: the results are bit-identical, the reducer's own included. A reply that does not
parse, or a payload in it that does not decode, makes the part implausible at the receiver (as a wrong
average would): a liar cannot make honest members apply different values without being caught.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from peers.wirecodec import PartCodec

ABSENT, ZERO, PAYLOAD = 0, 1, 2


def relays(codec: PartCodec | None) -> bool:
    """Whether parts in `codec` are relayed (a sparse codec says so) rather than reduced by their reducer."""
    return codec is not None and bool(getattr(codec, "relays_parts", False))


def statuses(num_senders: int, rows: Sequence[tuple[int, float]]) -> list[int]:
    """Each sender's status from the rows a reducer reduced: (sender index, weight), in sender order."""
    out = [ABSENT] * num_senders
    for sender, weight in rows:
        out[sender] = PAYLOAD if weight > 0 else ZERO
    return out


def pack_reply(status: Sequence[int], payloads: Mapping[int, bytes], receiver: int) -> bytes:
    """The reply to `receiver`: the statuses, then every PAYLOAD sender's payload but the receiver's."""
    forwarded = [payloads[s] for s, st in enumerate(status) if st == PAYLOAD and s != receiver]
    return bytes(status) + b"".join(forwarded)


def unpack_rows(
    reply: bytes,
    *,
    receiver: int,
    own_payload: bytes,
    codec: PartCodec,
    numel: int,
    weights: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [m, numel], weights [m]) of the senders the reducer reduced, in its order, decoded from `reply`
    (the receiver's own row from `own_payload`); None if the reply is malformed in any way."""
    n = len(weights)
    size = codec.encoded_size(numel)
    status = list(reply[:n])
    if len(status) != n or any(st not in (ABSENT, ZERO, PAYLOAD) for st in status):
        return None
    forwarded = sum(1 for s, st in enumerate(status) if st == PAYLOAD and s != receiver)
    if len(reply) != n + forwarded * size or (status[receiver] == PAYLOAD and weights[receiver] <= 0):
        return None
    rows, row_weights, offset = [], [], n
    for sender, st in enumerate(status):
        if st == ABSENT:
            continue
        if st == ZERO or weights[sender] <= 0:  # a weight-0 sender sent nothing a reducer would keep
            if st == PAYLOAD:
                return None
            rows.append(torch.zeros(numel))
            row_weights.append(0.0)
            continue
        if sender == receiver:
            payload = own_payload
        else:
            payload, offset = reply[offset : offset + size], offset + size
        try:
            rows.append(codec.decode(payload, numel))
        except Exception:  # a payload the reducer should have screened: it lied
            return None
        row_weights.append(float(weights[sender]))
    if not rows:
        return torch.zeros(0, numel), torch.zeros(0)
    return torch.stack(rows), torch.tensor(row_weights, dtype=torch.float32)
