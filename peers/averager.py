"""The run's averager: hivemind's DecentralizedAverager with the group's decisions made explicit.

It runs in its own process (hivemind's design); methods prefixed `_` below run there, the rest in the
host. What it adds:
- each round is keyed by its outer step (the group key's bits), so only peers at the same step meet, and
  by the run's codec when it compresses, so peers that encode parts differently never meet;
- members exchange tickets (`proto.ROUND_TICKET`) while matching; every member decides the same
  weights from the same gathered tickets: the (capped) tokens behind the contribution of members whose
  (step, θ hash) is the group majority, 0 for everyone else (they still take part, and learn that they
  must re-sync);
- results are exact (see `allreduce.py`) and land in the shared tensors a tensor at a time, each once
  all its parts are in; the daemon reads them only after a complete round;
- state downloads are for the run's peers only (`state/donors.py`); who counts in a group is decided
  from the gathered data in `membership.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch
from hivemind.averaging import averager as averager_module
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture

from peers import heap
from peers.allreduce import ExactAllReduceRunner
from peers.auth import RunAuth
from peers.deadlines import allreduce_cancelled_reason
from peers.grouping import reducer_bandwidths, share_by_bandwidth
from peers.membership import agree, decode_gathered, gathered_proof, normalized, warn_once
from peers.partreduce import PartCheck, PartReduce, PartReply
from peers.partrelay import PartWeigh
from peers.state.donors import StateDonors, StateProvider
from peers.wirecodec import PartCodec

log = logging.getLogger("peers.averager")
T = TypeVar("T")

# Each of the two waits of the averager's own shutdown (`RunAverager._shutdown`) lasts at most this long.
# The host waits 3 s for all of it (`shutdown_timeout` in peers/group.py), then terminates the process, and
# the daemon would take that SIGTERM, echoed through the averager, for a second signal (exit at once).
STOP_STEP_SECONDS = 1.0
# How long a finished round waits for our last replies to other senders to be counted in its bytes: they
# are encoded as our own averages arrive, so this is normally no wait at all.
REPLIES_COUNTED_SECONDS = 1.0


# hivemind's search for a leader re-reads the group key's averagers whenever its queue of candidates is
# empty, and waits for nothing else: a peer alone in its group key (a lone peer; the first to reach
# matchmaking) reads the DHT back to back for its whole matchmaking window, ~50 lookups a second that cost
# its DHT and averager processes half a core between them (bench/throughput.py --peer, docs/benchmarks.md).
# One read per this many seconds sees a new leader at most this late, against windows of seconds.
LEADER_POLL_SECONDS = 0.2


def _paced(read: Callable[..., Awaitable[T]], interval: float) -> Callable[..., Awaitable[T]]:
    """`read`, started at most once per `interval` seconds (a call too soon waits for its turn)."""
    next_at = 0.0

    async def paced(*args: Any, **kwargs: Any) -> T:
        nonlocal next_at
        wait = next_at - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        next_at = time.monotonic() + interval
        return await read(*args, **kwargs)

    return paced


class BanAwareMatchmaking(Matchmaking):
    """Matchmaking that neither accepts followers nor follows leaders this peer has banned, and that
    counts only trainers towards the smallest group it starts."""

    banned: frozenset[PeerID] = frozenset()
    auth: RunAuth | None = None  # the run key: set in the averager process (RunAverager.run)
    auxiliary: bool = False  # this averager only reduces (set in RunAverager.run)

    # hivemind starts a group as soon as `len(followers) + 1 >= min_group_size` when its search window
    # ends. Counting an auxiliary reducer there let one trainer and the bootstrap form a group that averages
    # nothing: the first trainer to reach matchmaking took the bootstrap and left, and one arriving a
    # second later met nobody. At H = 40 on loopback that split 3 peers into pairs round after round
    # (bench/rejoin.py). So every auxiliary reducer in the forming group raises the bar by one.
    @property
    def min_group_size(self) -> int:
        return self._min_trainers + self._auxiliaries_here()

    @min_group_size.setter
    def min_group_size(self, value: int) -> None:
        self._min_trainers = value

    def _auxiliaries_here(self) -> int:
        """Auxiliary reducers in the group this peer leads now: itself and followers that say they are one."""
        followers = getattr(self, "current_followers", {})  # hivemind sets min_group_size before it
        return int(self.auxiliary) + sum(_gathers_aux(request.gather) for request in followers.values())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Group keys are set per round from the outer step (`round_group_bits`); hivemind's own re-bucketing
        # after a group assembles is not used, and it fails when a group is larger than this peer's target
        # size (an auxiliary reducer can make it so).
        self.group_key_manager.update_key_on_group_assembled = _keep_group_key  # type: ignore[method-assign]
        self.group_key_manager.get_averagers = _paced(  # type: ignore[method-assign]
            self.group_key_manager.get_averagers, LEADER_POLL_SECONDS
        )

    def _check_reasons_to_reject(self, request: Any, context: Any) -> Any:
        if context.remote_id in self.banned:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        if self.auth is not None and not self.auth.admits_member(
            context.remote_id.to_bytes(), gathered_proof(MSGPackSerializer, request.gather)
        ):
            warn_once(f"refused peer {context.remote_id} into a group: it holds no valid run key")
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID) -> Any:
        if leader in self.banned:
            return None
        if (
            self.auth is not None
            and self.auth.allowed is not None
            and leader.to_bytes() not in self.auth.allowed
        ):
            return None
        return await super()._request_join_group(leader)


class RunAverager(StateDonors):
    def __init__(
        self,
        *args: Any,
        state_provider: StateProvider | None = None,
        reduce_part: PartReduce | None = None,
        check_part: PartCheck | None = None,
        weigh_part: PartWeigh | None = None,
        codec: PartCodec | None = None,
        reply_part: PartReply | None = None,
        auth: RunAuth | None = None,
        max_reducers: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before super().__init__ forks: the averager process inherits them.
        self._reduce_part, self._check_part, self._reply_part = reduce_part, check_part, reply_part
        self._weigh_part = weigh_part
        self._max_reducers = max_reducers
        self._codec = codec
        self._subset: list[int] | None = None  # which tensors the next round averages (None: all)
        super().__init__(*args, state_provider=state_provider, auth=auth, **kwargs)

    def run(self) -> None:
        # Runs in the averager process: hivemind builds its Matchmaking by this module-level name.
        averager_module.Matchmaking = BanAwareMatchmaking  # type: ignore[misc]
        BanAwareMatchmaking.auth = self._auth
        BanAwareMatchmaking.auxiliary = self.mode == AveragingMode.AUX
        super().run()

    def step(self, gather: Any = None, **kwargs: Any) -> Any:
        """Every member's gathered data is [ticket, run-key proof]; see `gathered_proof`."""
        proof = self._auth.member_proof(self.peer_id.to_bytes()) if self._auth is not None else b""
        return super().step(gather=[gather, proof], **kwargs)

    def set_group_bits(self, group_bits: str, wait: bool = True) -> Any:
        """hivemind's, bounded like the settings below: an executor thread that waits on an averager that
        stopped first would keep the process from exiting (asyncio waits for its threads)."""
        future = super().set_group_bits(group_bits, wait=False)
        return future.result(timeout=10) if wait else future

    def set_banned(self, peer_ids: Sequence[str]) -> None:
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_banned", [], dict(peer_ids=list(peer_ids), future=future)))
        future.result(timeout=10)

    def set_subset(self, subset: Sequence[int] | None) -> None:
        """Average only these tensors (by index) from the next round on; None: all (blocking, quick)."""
        future: MPFuture = MPFuture()
        chosen = None if subset is None else [int(i) for i in subset]
        self._outer_pipe.send(("_set_subset", [], dict(subset=chosen, future=future)))
        future.result(timeout=10)

    async def _set_subset(self, subset: list[int] | None, future: MPFuture) -> None:
        self._subset = subset
        future.set_result(None)

    async def _set_banned(self, peer_ids: list[str], future: MPFuture) -> None:
        banned = set()
        for text in peer_ids:
            try:
                banned.add(PeerID.from_base58(text))
            except Exception:
                continue
        self._matchmaking.banned = frozenset(banned)
        future.set_result(None)

    def set_group_target(self, trainers: int | None, window: float | None = None) -> None:
        """Form groups of up to this many members from the next round on (None: the configured size).
        A group that is full starts its all-reduce at once instead of waiting out the matchmaking window,
        so the daemon sets it to the live trainers of the run (plus auxiliary reducers) every round.
        `window`: the leader's matchmaking window for such a group (None: the configured one)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_group_target", [], dict(size=trainers, window=window, future=future)))
        future.result(timeout=10)

    async def _set_group_target(self, size: int | None, window: float | None, future: MPFuture) -> None:
        matchmaking = self._matchmaking
        if not hasattr(self, "_configured_group_size"):
            self._configured_group_size = matchmaking.target_group_size
            self._configured_window = matchmaking.min_matchmaking_time
        target = self._configured_group_size if size is None else max(2, int(size))
        matchmaking.target_group_size = target
        matchmaking.potential_leaders.target_group_size = target
        matchmaking.group_key_manager.target_group_size = target
        seconds = self._configured_window if window is None else float(window)
        matchmaking.min_matchmaking_time = matchmaking.potential_leaders.min_matchmaking_time = seconds
        future.set_result(None)

    def set_deadlines(self, allreduce_timeout: float) -> None:
        """Change the all-reduce deadline (blocking, quick). The per-chunk timeouts stay as configured:
        they bound how long members wait on each other within a round, which depends on their skew and
        links, not on how long whole rounds took."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(
            ("_set_deadlines", [], dict(allreduce_timeout=allreduce_timeout, future=future))
        )
        future.result(timeout=10)

    async def _set_deadlines(self, allreduce_timeout: float, future: MPFuture) -> None:
        self._allreduce_timeout = allreduce_timeout
        future.set_result(None)

    # ---- averager process ----------------------------------------------------------------------------
    async def _shutdown(self, timeout: float | None) -> None:
        """Stop quietly. Replaces hivemind's `DecentralizedAverager._shutdown` (hivemind 1.1.12,
        hivemind/averaging/averager.py:354), whose failures end the averager's thread with a traceback on
        the console of a peer that is only being stopped. Three of them:

        - It first unregisters our handlers from p2pd. After a SIGTERM to the whole process group (a
          service manager's stop, `kill -- -PGID`) p2pd is gone already: hivemind's DHT and averager
          processes do not act on the signal (the daemon stops them in order), but p2pd, the DHT
          process's child, exits on it and removes its control socket, so `remove_stream_handler` raised
          FileNotFoundError (p2p_daemon_bindings/control.py:410). A daemon that is gone holds no handlers.
        - It calls `finalize` on the values of `_running_groups`, which are futures of runners, not
          runners: a stop during an all-reduce raised AttributeError. Here the runner is finalized.
        - Then the averager process exits, while requests it sent the DHT process may still wait in the
          DHT's pipe. Each carries a future whose pipe the DHT fetches from *this* process (multiprocessing's
          resource sharer), which fails once we are gone: as EOFError, which the DHT's loop does not catch
          (dht/dht.py:128), the DHT process died with a traceback; as another error it logged one and
          paused. So every request from here on is withdrawn, and we exit once the DHT has read the ones
          sent before.
        """
        if not self.client_mode:
            try:
                await asyncio.wait_for(
                    self.remove_p2p_handlers(self._p2p, namespace=self.prefix), STOP_STEP_SECONDS
                )
            except Exception as e:  # p2pd is gone (or stuck): it serves no handler of ours any more
                log.debug("left our handlers to p2pd: %r", e)
        for future in self._running_groups.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()
        await self._withdraw_dht_requests()

    async def _step(self, *, step: Any, future_for_init: MPFuture) -> None:
        """hivemind's `_step`, without the traceback of a step we cancelled mid-all-reduce. Its result is
        set on a future that is already cancelled, and the mpfuture raises concurrent.futures'
        InvalidStateError, which hivemind does not catch: it names asyncio's own (hivemind 1.1.12,
        averaging/averager.py:456 and :474), so the task ended with "Task exception was never retrieved"
        and a traceback in the peer's log on every round the driver gave up mid-exchange."""
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        except concurrent.futures.InvalidStateError as e:
            if not step.cancelled():
                raise
            log.debug("a cancelled round's result was dropped: %r", e)
        finally:  # the round's parts, codec buffers and averages (≥ 2 × Δ) are free: give their pages back
            heap.trim()

    async def _withdraw_dht_requests(self) -> None:
        """Send the DHT process a last request, withdraw all later ones, and wait until it answers: its
        pipe is read in order, so by then it has taken every request we sent (see `_shutdown`)."""
        dht = self.dht
        last = dht.run_coroutine(_answer_nothing, return_future=True)
        dht._outer_pipe = _WithdrawnRequests()  # this process's copy of the DHT handle only
        try:
            await asyncio.wait_for(last, STOP_STEP_SECONDS)
        except Exception as e:  # a DHT process that is gone or stuck reads nothing more of ours either
            log.debug("the DHT did not answer our last request: %r", e)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            self._check_members(group_info)
            bandwidths, modes, tickets = decode_gathered(self.serializer, group_info.gathered)
            agreement = agree(tickets, modes, [peer.to_base58() for peer in group_info.peer_ids])
            weights = agreement.weights
            if not any(weights):
                raise AllreduceException("no member of the group holds a valid ticket with tokens")
            trusted = [m and not b for m, b in zip(agreement.in_majority, agreement.banned)]
            download = reducer_bandwidths(bandwidths, modes, trusted, self._max_reducers)
            subset = self._subset  # a fragment: only these tensors go on the wire
            total_size = self.total_size
            if subset is not None:
                total_size = sum(self._averaged_tensors[i].numel() for i in subset)
                if kwargs.get("tensor_infos") is not None:
                    kwargs["tensor_infos"] = [kwargs["tensor_infos"][i] for i in subset]
            fractions = share_by_bandwidth(total_size, download)
            kwargs.pop("weight", None)  # the sender's own claim is never used
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                chosen = local_tensors if subset is None else [local_tensors[i] for i in subset]
                runner = await self._run_exact_allreduce(
                    chosen, group_info, modes, normalized(weights), peer_fractions=fractions, **kwargs
                )
            my_index = group_info.peer_ids.index(self.peer_id)
            return dict(
                peers=[peer.to_base58() for peer in group_info.peer_ids],
                weights=list(weights),  # tokens, as agreed (the reducers used them divided by the largest)
                my_weight=weights[my_index],
                in_majority=agreement.in_majority[my_index],
                majority_size=sum(agreement.in_majority),
                majority=[p.to_base58() for p, m in zip(group_info.peer_ids, agreement.in_majority) if m],
                banned=agreement.banned[my_index],
                failed_size=runner.failed_size,
                screened=runner.screened_parts,
                faulty=sorted(peer.to_base58() for peer in runner.faulty_senders),
                rejected_reducers=sorted(peer.to_base58() for peer in runner.rejected_reducers),
                reducer_errors=sorted(
                    f"{peer.to_base58()}: {why}" for peer, why in runner.reducer_errors.items()
                ),
                bytes_sent=runner.bytes_sent,
                bytes_received=runner.bytes_received,
                allreduce_seconds=time.monotonic() - started,
            )
        except AllreduceException:
            raise
        except asyncio.CancelledError as e:
            reason = allreduce_cancelled_reason(time.monotonic() - started, self._allreduce_timeout)
            raise AllreduceException(reason) from e
        except BaseException as e:
            raise AllreduceException(f"all-reduce failed: {e!r}") from e

    def _check_members(self, group_info: GroupInfo) -> None:
        """Refuse a group with a member that holds no run key (only a dishonest leader assembles one)."""
        if self._auth is None:
            return
        for peer, blob in zip(group_info.peer_ids, group_info.gathered):
            if not self._auth.admits_member(peer.to_bytes(), gathered_proof(self.serializer, blob)):
                raise AllreduceException(f"refused the group: member {peer} holds no valid run key")

    async def _run_exact_allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        modes: Sequence[AveragingMode],
        weights: Sequence[float],
        **kwargs: Any,
    ) -> ExactAllReduceRunner:
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_info.group_id,
            ordered_peer_ids=group_info.peer_ids,
            modes=modes,
            sender_weights=dict(zip(group_info.peer_ids, weights)),
            reduce_part=self._reduce_part,
            check_part=self._check_part,
            weigh_part=self._weigh_part,
            codec=self._codec,
            reply_part=self._reply_part,
            **kwargs,
        )
        self._running_groups[group_info.group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise AllreduceException("an auxiliary reducer received averaged tensors")
            return runner
        # Each tensor's average replaces our input as soon as all its parts are in, not once the whole
        # model's averages were collected (a copy of the model in this process at every round's peak).
        # Safe for the parts still on the wire: a tensor is complete only after every reducer answered
        # each of its parts, so we had sent them all. An incomplete round leaves some tensors averaged
        # and the rest ours; the daemon reads the buffers only after a complete one (`RoundOutcome`).
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        await runner.replies_counted(REPLIES_COUNTED_SECONDS)  # the round's bytes include our last replies
        return runner


def _gathers_aux(blob: bytes) -> bool:
    """Whether a join request's gathered data says its sender is an auxiliary reducer (malformed: no)."""
    try:
        return bool(MSGPackSerializer.loads(blob)[1] == AveragingMode.AUX.value)
    except Exception:
        return False


async def _keep_group_key(_group_info: GroupInfo) -> None:
    return None


async def _answer_nothing(_dht: Any, _node: Any) -> None:
    """The averager's last DHT request (run in the DHT process): its answer says the DHT read all before it."""
    return None


class _WithdrawnRequests:
    """Where a stopping averager's DHT handle sends requests instead of the DHT's pipe: each request's future
    is cancelled (whoever waits on it stops waiting) and nothing leaves the process."""

    def send(self, message: Any) -> None:
        _method, _args, kwargs = message
        future = kwargs.get("future")
        if isinstance(future, MPFuture):
            future.cancel()
