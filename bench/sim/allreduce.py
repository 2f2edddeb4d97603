"""A group's all-reduce in one process: the average every member of a real group applies, bit for bit.

What `peers/allreduce.py` does across the network, done here with the same functions in the same order:
- the weights are the tokens behind each contribution, capped (`peers.membership.capped_tokens`), divided
  by the largest (`normalized`) and handed to each reducer as float32, as the averager does;
- every tensor is cut into hivemind's parts (`DEFAULT_PART_SIZE_BYTES` / 4 values from each tensor's
  start); with a codec, each sender's copy of a part is what its payload decodes to
  (`peers.wirecodec`), and a copy that does not decode, is not finite or has weight 0 enters as zeros
  with weight 0 (`ExactAllReduceRunner._screen`);
- each part is reduced by the run's `reduce_part` (screening and the configured reducer,
  `dilocod.aggregation.partrules`) over the senders in group order, then re-encoded once with the codec
  (`requantize`), which is what every member keeps; a relayed codec's (`topk`) result is kept as reduced,
  as every member reduces the relayed payloads itself (`peers/partrelay.py`).

Not modelled: which member reduces which part (it changes no value), the receivers' plausibility check
of averages (it never fires between honest replicas), failed reducers and bans.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from dilocod.codecs import Codec, NoneCodec
from peers.membership import Claim, capped_tokens, normalized
from peers.partreduce import PartReduce
from peers.partrelay import relays
from peers.wirecodec import decode_message, encode_or_empty, payload_message, requantize

# Values per part: hivemind splits each fp32 tensor into parts of DEFAULT_PART_SIZE_BYTES (our codecs
# report a compression ratio of 1, so the split is the same whatever the codec).
PART_SIZE = DEFAULT_PART_SIZE_BYTES // 4


def agreed_weights(claims: Sequence[Claim]) -> list[float]:
    """The weight of each member's contribution: its tokens, capped as every member of a group caps them."""
    return capped_tokens(list(claims))


def group_average(
    sent: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    reduce_part: PartReduce,
    codec: Codec | None,
) -> list[torch.Tensor]:
    """The group's average of each tensor; `sent[i][t]` is member i's tensor t (members in group order)."""
    scaled = normalized(list(weights))  # what the averager hands its all-reduce (float32 at each reducer)
    return [
        _average_tensor([member[t] for member in sent], scaled, reduce_part, codec)
        for t in range(len(sent[0]))
    ]


def _average_tensor(
    copies: Sequence[torch.Tensor], weights: Sequence[float], reduce_part: PartReduce, codec: Codec | None
) -> torch.Tensor:
    shape = copies[0].shape
    flats = [copy.detach().to(torch.float32).reshape(-1) for copy in copies]
    parts = [
        _average_part([flat[start : start + PART_SIZE] for flat in flats], weights, reduce_part, codec)
        for start in range(0, flats[0].numel(), PART_SIZE)
    ]
    return torch.cat(parts).view(shape)


def _average_part(
    copies: Sequence[torch.Tensor], weights: Sequence[float], reduce_part: PartReduce, codec: Codec | None
) -> torch.Tensor:
    rows, kept = [], []
    for copy, weight in zip(copies, weights):
        received = copy if codec is None else _through_codec(codec, copy)
        usable = received is not None and weight != 0.0 and bool(torch.isfinite(received).all())
        rows.append(received if usable and received is not None else torch.zeros_like(copy))
        kept.append(weight if usable else 0.0)
    reduced, _faulty = reduce_part(torch.stack(rows), torch.tensor(kept, dtype=torch.float32))
    reduced = reduced.to(torch.float32)
    if codec is not None and not relays(codec):  # one payload back; every member keeps what it decodes to
        reduced, _payload = requantize(codec, reduced)
    return reduced


def _through_codec(codec: Codec, part: torch.Tensor) -> torch.Tensor | None:
    """What a reducer makes of a sender's part: its payload decoded (None: screened out)."""
    message = payload_message(encode_or_empty(codec, part))
    return decode_message(codec, message, part.numel())


def payload_bytes(tensors: Sequence[torch.Tensor], codec: Codec | None) -> int:
    """Bytes a member's parts of `tensors` take on the wire (payloads only: no framing, no replies)."""
    size = (codec or NoneCodec()).encoded_size
    return sum(
        size(min(PART_SIZE, t.numel() - start)) for t in tensors for start in range(0, t.numel(), PART_SIZE)
    )
