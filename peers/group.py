"""The small async API the daemon uses to average with its group and to fetch state from peers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.matchmaking import MatchmakingException

from peers.averager import RunAverager
from peers.deadlines import AdaptiveDeadlines, DeadlineBounds
from peers.errors import PeersError
from peers.forking import freeze_before_fork
from peers.grouping import chunk_timeout, matchmaking_window, round_group_bits
from peers.linkbudget import DEFAULT_RATE, LinkEstimate, LinkRule, allreduce_deadline, state_deadline
from peers.node import Node, stop_child
from peers.partreduce import PartCheck, PartReduce, PartReply
from peers.partrelay import PartWeigh
from peers.shmem import release
from peers.state.donors import StateProvider
from peers.wirecodec import PartCodec


@dataclass(frozen=True)
class AveragingSettings:
    target_group_size: int = 8
    min_group_size: int = 2
    min_matchmaking_time: float = 3.0
    matchmaking_timeout: float = 15.0
    allreduce_timeout: float = 60.0
    request_timeout: float = 3.0
    # Deadlines follow recent rounds (see `peers/deadlines.py`): the two timeouts above are the ceilings.
    adaptive_deadlines: bool = True
    deadline_factor: float = 3.0
    min_allreduce_timeout: float = 5.0
    mode: str = "node"  # "node": sends and reduces | "client": sends only (behind NAT) | "aux": reduces only
    max_reducers: int | None = None  # trainers of a group that reduce (None: every reachable one)
    bandwidth: float | None = None  # relative download bandwidth, used to size each reducer's share
    # How a reducer combines the n copies of a part (default: the mean) and how a member checks an average
    # it receives; both are pure functions supplied by the caller.
    reduce_part: PartReduce | None = field(default=None, compare=False)
    check_part: PartCheck | None = field(default=None, compare=False)
    # With a codec whose parts are relayed (peers/partrelay.py): how a reducer weighs the rows every member
    # then combines (default: the weighted mean); `reduce_part` is not used then.
    weigh_part: PartWeigh | None = field(default=None, compare=False)
    # How parts travel: None sends exact fp32; a codec encodes every part and every average (and keys the
    # matchmaking by its name, so only peers with the same codec meet).
    codec: PartCodec | None = field(default=None, compare=False)
    reply_part: PartReply | None = field(
        default=None, compare=False
    )  # what we send back for a part we reduced
    run_tag: str | None = None  # keys matchmaking (the run manifest's hash): other tags never meet
    # Auto deadlines (peers/linkbudget.py): the model's size and which deadlines follow the measured link.
    link: LinkRule | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RoundOutcome:
    """What one averaging attempt gave. `averaged` is set only when this peer may apply it."""

    found_group: bool
    group_size: int
    contributors: int  # members whose contribution counted (weight > 0)
    in_majority: bool
    complete: bool
    averaged: list[torch.Tensor] | None
    seconds: float
    error: str | None = None
    faulty: tuple[str, ...] = ()  # senders whose contribution our reducer dropped
    rejected_reducers: tuple[str, ...] = ()  # reducers whose average we refused
    reducer_errors: tuple[str, ...] = ()  # "peer: reason" for each reducer whose averages did not all arrive
    members: tuple[str, ...] = ()
    # the members that held the group's θ_global (banned or not): their Δ is measured from it, so only they
    # can be scored for this round (a member out of step sent a Δ from another θ_global)
    majority: tuple[str, ...] = ()
    bytes_sent: int = 0  # tensor payload bytes this round, both directions of the all-reduce
    bytes_received: int = 0
    banned: bool = False  # our θ_global was the group's, but most of the group bans us
    majority_size: int = 0  # trainers that held the group's θ_global (with tokens or not): all apply it
    allreduce_seconds: float = 0.0  # of `seconds`, the all-reduce (the rest is matchmaking)
    my_weight: float = 0.0  # the tokens the group counted for our contribution (capped)
    total_weight: float = 0.0  # ... for all contributions together


def incomplete_reason(reducer_errors: tuple[str, ...]) -> str:
    """Why a round that formed a group gave no result: the reducers whose averages did not all arrive."""
    if not reducer_errors:
        return "incomplete: a member or reducer vanished mid-round"
    return "incomplete: " + "; ".join(reducer_errors)


@dataclass(frozen=True)
class DownloadedState:
    donor: str
    claimed_step: float
    meta: bytes
    tensors: list[torch.Tensor]


class GroupAverager:
    """Owns the averager process; every public method is safe to await from the daemon's loop."""

    def __init__(
        self,
        node: Node,
        template: Sequence[torch.Tensor],
        options: AveragingSettings,
        state_provider: StateProvider | None,
    ) -> None:
        self.node = node
        self.options = options
        self.num_elements = sum(t.numel() for t in template)
        self._buffers = [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in template]
        self._state_provider = state_provider
        self._averager: RunAverager | None = None
        self._control: StepControl | None = None
        self._subset: list[int] | None = None  # the tensors the averager process averages (None: all)
        self._group_target: int | None = None  # the group size the averager process aims for (None: config)
        self.deadlines = AdaptiveDeadlines(
            DeadlineBounds(
                matchmaking_ceiling=options.matchmaking_timeout,
                matchmaking_floor=min(
                    options.matchmaking_timeout, options.min_matchmaking_time + 2 * options.request_timeout
                ),
                allreduce_ceiling=options.allreduce_timeout,
                allreduce_floor=min(options.allreduce_timeout, options.min_allreduce_timeout),
                factor=options.deadline_factor,
                adaptive=options.adaptive_deadlines,
            )
        )
        self._allreduce_deadline = options.allreduce_timeout  # what the averager process uses now
        self.link = LinkEstimate(options.link.prior if options.link is not None else DEFAULT_RATE)
        self._window = options.min_matchmaking_time  # the leader's matchmaking window for the group target

    @property
    def matchmaking_deadline(self) -> float:
        """The next round's matchmaking deadline: the adaptive one, but never shorter than the window for
        the group we aim for (the adaptive floor is the configured window's) plus two requests' slack."""
        opts = self.options
        return min(
            opts.matchmaking_timeout, max(self.deadlines.matchmaking, self._window + 2 * opts.request_timeout)
        )

    def start(self) -> None:
        """Fork the averager process (blocking; call from an executor)."""
        opts = self.options
        if opts.mode not in ("node", "client", "aux"):
            raise PeersError(f"unknown averaging mode '{opts.mode}'")
        freeze_before_fork()
        self._averager = RunAverager(
            self._buffers,
            self.node.started,
            start=True,
            prefix=self.node.options.run_id,
            target_group_size=opts.target_group_size,
            min_group_size=opts.min_group_size,
            min_matchmaking_time=opts.min_matchmaking_time,
            request_timeout=opts.request_timeout,
            allreduce_timeout=opts.allreduce_timeout,
            next_chunk_timeout=chunk_timeout(opts.allreduce_timeout, opts.request_timeout),
            client_mode=opts.mode == "client",
            auxiliary=opts.mode == "aux",
            allow_state_sharing=opts.mode == "node" and self._state_provider is not None,
            bandwidth=opts.bandwidth,
            state_provider=self._state_provider,
            reduce_part=opts.reduce_part,
            check_part=opts.check_part,
            weigh_part=opts.weigh_part,
            codec=opts.codec,
            reply_part=opts.reply_part,
            max_reducers=opts.max_reducers,
            auth=self.node.auth,  # members prove the run key; the leader and members check (peers/auth.py)
            declare_state_period=10,
            shutdown_timeout=3,
        )

    @property
    def averager(self) -> RunAverager:
        if self._averager is None:
            raise PeersError("the averager is not running")
        return self._averager

    def stop(self) -> None:
        averager, self._averager = self._averager, None
        if averager is not None:
            stop_child(averager, timeout=5)

    @property
    def in_allreduce(self) -> bool:
        """True while tensors are being exchanged: leaving now would cost the group its parts."""
        control = self._control
        return (
            control is not None and not control.done() and control.stage == AveragingStage.RUNNING_ALLREDUCE
        )

    def set_state_step(self, outer_step: int) -> None:
        """Donors are ranked by the outer step they hold (verified by the downloader, not trusted)."""
        if self.averager.allow_state_sharing:  # clients and auxiliary reducers serve no state
            self.averager.state_sharing_priority = float(outer_step)

    async def average(
        self,
        round_index: int,
        ticket: bytes,
        tensors: Sequence[torch.Tensor],
        subset: Sequence[int] | None = None,
        group_target: int | None = None,
    ) -> RoundOutcome:
        """Average `tensors` with the peers at the same round; never waits past the configured deadlines.

        With `subset` (indices into the template), `tensors` are those tensors only: only they cross the
        wire, the outcome's `averaged` holds them alone, and only peers averaging the same subset meet.
        `group_target`: the members expected (the run's live trainers and reducers); a group that has them
        all starts at once instead of waiting out the matchmaking window. None: the configured size.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        averager = self.averager
        chosen = None if subset is None else list(subset)
        with averager.get_tensors() as shared:
            targets = shared if chosen is None else [shared[i] for i in chosen]
            for buffer, tensor in zip(targets, tensors, strict=True):
                buffer.copy_(tensor)
        if chosen != self._subset:
            await loop.run_in_executor(None, averager.set_subset, chosen)
            self._subset = chosen
        codec_name = None if self.options.codec is None else self.options.codec.wire_name
        bits = round_group_bits(round_index, codec_name, chosen, self.options.run_tag)
        await loop.run_in_executor(None, averager.set_group_bits, bits)
        if group_target != self._group_target:
            opts = self.options
            self._window = matchmaking_window(
                opts.min_matchmaking_time, group_target, opts.matchmaking_timeout, opts.request_timeout
            )
            await loop.run_in_executor(None, averager.set_group_target, group_target, self._window)
            self._group_target = group_target
        matchmaking, allreduce = self.matchmaking_deadline, self.deadlines.allreduce
        if allreduce != self._allreduce_deadline:
            await loop.run_in_executor(None, averager.set_deadlines, allreduce)
            self._allreduce_deadline = allreduce
        control = await loop.run_in_executor(
            None,
            lambda: averager.step(gather=ticket, timeout=matchmaking, allow_retries=True, wait=False),
        )
        self._control = control
        outcome = await self._await_round(control, matchmaking + allreduce + 5.0, started, chosen)
        self._learn(outcome)
        return outcome

    async def _await_round(
        self, control: StepControl, budget: float, started: float, chosen: list[int] | None
    ) -> RoundOutcome:
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(control), budget)
        except TimeoutError:
            # A process stopped past the budget (SIGSTOP, a suspended laptop) wakes to a step the averager
            # may have finished meanwhile: then there is nothing left to cancel.
            with contextlib.suppress(InvalidStateError):
                control.cancel()
            return _failed(loop.time() - started, "timed out", found_group=True)
        except MatchmakingException as e:
            outcome = _failed(
                loop.time() - started, str(e), found_group="could not find a group" not in str(e)
            )
        except Exception as e:
            message = str(e) or type(e).__name__
            outcome = _failed(
                loop.time() - started, message, found_group="could not find a group" not in message
            )
        else:
            outcome = self._outcome(result, loop.time() - started)  # clones the average out first
        # The averager's step is over (it set the result): until the next round writes them, the shared
        # buffers hold nothing anyone reads, so their pages go back (peers/shmem.py). Not after a round we
        # cancelled at its deadline (above): its all-reduce may still be sending parts from them. Only this
        # round's own buffers (`chosen`): with streaming, the next fragment's round may have written its own.
        with self.averager.get_tensors() as shared:
            release(shared if chosen is None else [shared[i] for i in chosen])
        return outcome

    def _learn(self, outcome: RoundOutcome) -> None:
        """What a round says about the deadlines: a completed one is measured; an all-reduce cut by its
        deadline before any measurement halves the assumed link (else a node whose first guess was too
        fast would time out every round, and a failed round is never measured)."""
        if outcome.averaged is not None:
            self.deadlines.observe(outcome.seconds - outcome.allreduce_seconds, outcome.allreduce_seconds)
            self._measured(max(outcome.bytes_sent, outcome.bytes_received), outcome.allreduce_seconds,
                           outcome.group_size)  # fmt: skip
            return
        rule = self.options.link
        errors = (outcome.error or "", *outcome.reducer_errors)
        if outcome.found_group and any("timed out" in e for e in errors) and not self.link.measured:
            self.link.timed_out()
            if rule is not None and rule.allreduce:
                group = max(outcome.group_size, self.options.target_group_size)
                self._set_allreduce_ceiling(rule, group)

    def _measured(self, nbytes: int, seconds: float, group: int | None = None) -> None:
        """A completed transfer: the link estimate learns from it, and an auto all-reduce ceiling follows."""
        self.link.observe(nbytes, seconds)
        rule = self.options.link
        if rule is not None and rule.allreduce and group is not None and self.link.measured:
            self._set_allreduce_ceiling(rule, group)

    def _set_allreduce_ceiling(self, rule: LinkRule, group: int) -> None:
        """The auto all-reduce ceiling for a group of `group` members, of which at most `max_reducers`
        trainers reduce (the run's auxiliary reducers are left out: fewer reducers, each busier)."""
        ceiling = allreduce_deadline(rule.size, group, self.link.rate, self.options.max_reducers)
        self.deadlines.set_allreduce_ceiling(ceiling)

    def state_timeout(self, configured: float) -> float:
        """One state download's deadline: `configured`, or with auto the rule at the measured rate."""
        rule = self.options.link
        return state_deadline(rule.size, self.link.rate) if rule is not None and rule.state else configured

    def _outcome(self, result: dict, seconds: float) -> RoundOutcome:
        in_majority = bool(result["in_majority"]) and not bool(result["banned"])
        complete = int(result["failed_size"]) == 0
        weights = [float(w) for w in result["weights"]]
        averaged = None
        if in_majority and complete:
            with self.averager.get_tensors() as shared:
                chosen = shared if self._subset is None else [shared[i] for i in self._subset]
                averaged = [buffer.clone() for buffer in chosen]
        return RoundOutcome(
            found_group=True,
            group_size=len(result["peers"]),
            contributors=sum(1 for w in weights if w > 0),
            in_majority=in_majority,
            complete=complete,
            averaged=averaged,
            seconds=seconds,
            faulty=tuple(result.get("faulty", ())),
            rejected_reducers=tuple(result.get("rejected_reducers", ())),
            reducer_errors=tuple(result.get("reducer_errors", ())),
            members=tuple(result["peers"]),
            majority=tuple(result.get("majority", ())),
            bytes_sent=int(result.get("bytes_sent", 0)),
            bytes_received=int(result.get("bytes_received", 0)),
            banned=bool(result["banned"]),
            majority_size=int(result["majority_size"]),
            allreduce_seconds=float(result.get("allreduce_seconds", 0.0)),
            my_weight=float(result["my_weight"]),
            total_weight=sum(weights),
        )

    def set_banned(self, peer_ids: Sequence[str]) -> None:
        """Refuse to form groups with these peers (blocking, quick)."""
        self.averager.set_banned(peer_ids)

    async def download_state(
        self, *, exclude: Sequence[str], min_step: int, max_elements: int, timeout: float
    ) -> DownloadedState | None:
        started = asyncio.get_running_loop().time()
        future = self.averager.download_state(
            exclude=exclude, min_step=min_step, max_elements=max_elements, timeout=timeout
        )
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout * 3 + 5)
        except TimeoutError:
            return None
        if result is None:
            return None
        donor, claimed, meta, tensors = result
        state = DownloadedState(donor=donor, claimed_step=claimed, meta=meta, tensors=list(tensors))
        self._measured(self.payload_bytes(state), asyncio.get_running_loop().time() - started)
        return state

    @staticmethod
    def payload_bytes(state: DownloadedState) -> int:
        return len(state.meta) + sum(t.numel() * t.element_size() for t in state.tensors)


def _failed(seconds: float, error: str, *, found_group: bool) -> RoundOutcome:
    return RoundOutcome(
        found_group=found_group,
        group_size=0,
        contributors=0,
        in_majority=False,
        complete=False,
        averaged=None,
        seconds=seconds,
        error=error.split("\n")[0],
    )
