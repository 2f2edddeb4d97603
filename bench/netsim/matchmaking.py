"""How the peers that closed a round find each other: hivemind's leader/follower matchmaking, modelled.

The daemon's rules decide the numbers: every member waits for `clock.group_target` members (the live
trainers of its round and the auxiliary reducers, at least its last group), and a leader waits
`grouping.matchmaking_window` for them (a full group starts at once). What is modelled is hivemind's
procedure, which is network I/O: a node that accepts connections (a public trainer or an auxiliary
reducer; a client cannot lead) declares itself a leader under the round's group key, a follower finds
it with a DHT lookup and asks to join, and the leader admits requests one at a time (its join lock,
ADMIT_SECONDS each). When the group is full or the window has passed, the leader sends every follower the
gathered tickets of all members (n × n tickets from its uplink). Peers it did not admit look for the next
leader among themselves; a peer that found no group of at least `min_group_size` trainers by its
matchmaking deadline ends without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.netsim import costs

ADMIT_SECONDS = 0.005  # a leader's event loop per join request (a stream, a protobuf, the checks): a guess


@dataclass(frozen=True)
class Seeker:
    """A node that entered matchmaking."""

    peer_id: str
    at: float
    leads: bool  # accepts connections: a public trainer or an auxiliary reducer
    trainer: bool  # False: an auxiliary reducer (no weight, counts in no minimum)
    rtt: float
    up: float  # bytes/s, for the leader's begin messages


@dataclass(frozen=True)
class Group:
    members: tuple[Seeker, ...]  # the leader first, then in the order admitted
    begins: float  # when the all-reduce starts (every follower has the gathered tickets)


@dataclass(frozen=True)
class Rules:
    target: int  # clock.group_target
    window: float  # grouping.matchmaking_window
    timeout: float  # the matchmaking deadline
    min_trainers: int  # averaging.min_group_size
    peers: int  # nodes in the DHT, for a lookup's hops
    ticket_bytes: int


def form_groups(seekers: Sequence[Seeker], rules: Rules) -> tuple[list[Group], list[Seeker]]:
    """The groups that form, and the seekers left without one."""
    pending = sorted(seekers, key=lambda s: (s.at, s.peer_id))
    first = {s.peer_id: s.at for s in seekers}
    groups: list[Group] = []
    alone: list[Seeker] = []
    while pending:
        leader = next((s for s in pending if s.leads), None)
        if leader is None:  # nobody can accept a connection: clients cannot meet each other
            return groups, alone + pending
        group, rest, rejected_at = _gather(leader, [s for s in pending if s is not leader], rules)
        trainers = sum(s.trainer for s in group)
        if trainers >= rules.min_trainers:
            groups.append(Group(tuple(group), rejected_at + _begin_seconds(group, rules)))
        else:
            alone.append(leader)  # too few came: it leaves without a group; the others look on
            rest += [s for s in group if s is not leader]
        # whoever was not admitted looks again from when this leader stopped admitting
        retried = [Seeker(s.peer_id, max(s.at, rejected_at), s.leads, s.trainer, s.rtt, s.up) for s in rest]
        late = [s for s in retried if s.at - first[s.peer_id] > rules.timeout]
        alone += late
        pending = sorted((s for s in retried if s not in late), key=lambda s: (s.at, s.peer_id))
    return groups, alone


def _gather(leader: Seeker, others: list[Seeker], rules: Rules) -> tuple[list[Seeker], list[Seeker], float]:
    """The members one leader admits, those it does not, and when it stopped admitting."""
    lookup = costs.lookup_seconds(rules.peers, leader.rtt)
    visible = leader.at + lookup  # its declaration is stored in the DHT
    closes = leader.at + rules.window
    requests = sorted(
        (max(s.at, visible) + costs.lookup_seconds(rules.peers, s.rtt) + (s.rtt + leader.rtt) / 4, s)
        for s in others
        if s.at < closes
    )  # a follower's request reaches the leader after its lookup and half a round trip
    group, rest = [leader], [s for s in others if s.at >= closes]
    admitted = leader.at
    for asked, seeker in ((t, s) for t, s in requests):
        when = max(asked, admitted) + ADMIT_SECONDS
        if len(group) < rules.target and when <= closes:
            group.append(seeker)
            admitted = when
        else:
            rest.append(seeker)
    full = len(group) >= rules.target
    return group, rest, admitted if full else closes


def _begin_seconds(group: Sequence[Seeker], rules: Rules) -> float:
    """The leader sends each follower every member's ticket (hivemind's gathered data) from its uplink."""
    n = len(group)
    return (n - 1) * n * rules.ticket_bytes / group[0].up + group[0].rtt
