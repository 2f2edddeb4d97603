"""Pure decisions about a round's group: its matchmaking key, who reduces how much, how long to wait.

Every member computes these from the same inputs (the step, the codec, the gathered data), so they
agree without another message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.load_balancing import hagenbach_bishoff

# Seconds of matchmaking window per expected member. A leader admits its followers one join request at a
# time, and followers find leaders through DHT lookups, so gathering a group takes longer the more members
# it needs. A group that has them all starts at once, so a longer window costs only when someone expected
# does not come. Measured (bench/hetero.py, 16 public peers on 2 cores, with the last-group floor of
# `clock.group_target`): successful groups of 3 members (median) with the 1.5 s window, 8-10 with it grown.
WINDOW_PER_MEMBER = 0.25


def matchmaking_window(
    configured: float, members: int | None, matchmaking_timeout: float, request_timeout: float
) -> float:
    """How long a group's leader waits for its members: `averaging.min_matchmaking_time`, or longer for a
    group of many (`WINDOW_PER_MEMBER` each), never so long that matchmaking could not finish within its
    timeout (the window plus two requests' slack)."""
    wanted = max(configured, WINDOW_PER_MEMBER * (members or 0))
    return max(configured, min(wanted, matchmaking_timeout - 2 * request_timeout))


def chunk_timeout(allreduce_timeout: float, request_timeout: float) -> float:
    """How long an all-reduce waits for a peer's next chunk before giving up on that peer."""
    return max(request_timeout, allreduce_timeout / 4)


def share_by_bandwidth(total_size: int, bandwidths: Sequence[float | None]) -> tuple[int, ...]:
    """How many values each member reduces: in proportion to its stated download bandwidth.

    Every sender sends each reducer that reducer's share and gets its average back, so a reducer's
    traffic grows with its share and ∝ bandwidth gives every reducer the same time. (hivemind's linear
    program instead counts each reducer as also sending a whole vector of its own, which an auxiliary
    reducer does not, and so gives a slower reducer nothing at all.) 0 = reduces nothing; None = the
    mean of the stated ones, or equal shares when nobody states one.
    """
    stated = [b for b in bandwidths if b is not None and b > 0]
    default = sum(stated) / len(stated) if stated else 1.0
    scores = [default if b is None else max(0.0, b) for b in bandwidths]
    if not any(scores):
        raise AllreduceException("no member of the group can reduce")
    return tuple(int(n) for n in hagenbach_bishoff(total_size, scores))


# Which wire protocol a round speaks: peers of another version never share a matchmaking key (a v2 peer's
# ticket has no tokens; see proto.ROUND_TICKET), so they never meet rather than fail each other's rounds.
# v5: a sender closes each reducer's stream once it has the averages, and the reducer waits for that
# (peers/allreduce.py); a v4 sender would wait for the reducer's close instead.
ROUND_PROTOCOL = "dilocod.round.5"


def round_group_bits(
    round_index: int,
    codec_name: str | None = None,
    subset: Sequence[int] | None = None,
    run_tag: str | None = None,
) -> str:
    """Group-key bits that put only peers at the same outer step into the same matchmaking bucket.

    32 bits of the step, then 16 bits from a hash of the round protocol, the codec's name (peers whose
    parts would not decode for each other look for groups under different keys) and, for one fragment,
    its tensor indices (only peers averaging the very same tensors meet) and the run's tag (the hash of
    the run manifest: nodes of different manifests look for groups under different keys).
    """
    bits = format(round_index % 2**32, "032b")
    name = f"{ROUND_PROTOCOL}.codec.{codec_name}"
    if subset is not None:
        name += ".tensors." + ",".join(str(i) for i in subset)
    if run_tag is not None:
        name += f".run.{run_tag}"
    tag = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")
    return bits + format(tag, "016b")


def reducer_bandwidths(
    bandwidths: Sequence[float | None],
    modes: Sequence[AveragingMode],
    trusted: Sequence[bool],
    max_trainers: int | None,
) -> list[float | None]:
    """Which members reduce a share of the parts (0.0: none), in the group's order.

    Only trusted members reduce: a member outside the group's majority (out of step, or banned by most)
    would otherwise still average a share of everybody's parts. Auxiliary reducers always reduce. Of the
    trainers, at most `max_trainers` do (the first in the group's order, which every member shares): a
    group holds every live trainer of the run, and capping its reducers caps the streams each member
    opens and the members whose failure can cut a round short.
    """
    shares: list[float | None] = []
    trainers = 0
    for bandwidth, mode, ok in zip(bandwidths, modes, trusted):
        reduces = mode == AveragingMode.AUX
        if mode == AveragingMode.NODE and ok and (max_trainers is None or trainers < max_trainers):
            reduces, trainers = True, trainers + 1
        shares.append(bandwidth if reduces else 0.0)
    return shares
