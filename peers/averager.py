"""The run's averager: hivemind's DecentralizedAverager with the group's decisions made explicit.

It runs in its own process (hivemind's design); methods prefixed `_` below run there, the rest in the
host. What it adds:
- each round is keyed by its outer step (the group key's bits), so only peers at the same step meet, and
  by the run's codec when it compresses, so peers that encode parts differently never meet;
- members exchange tickets (`proto.ROUND_TICKET`) while matching; every member decides the same
  weights from the same gathered tickets: 1 for members whose (step, θ hash) is the group majority,
  0 for everyone else (they still take part, and learn that they must re-sync);
- results are exact (see `allreduce.py`) and land in the shared tensors only when complete, so a
  failed round leaves the inputs intact;
- state downloads skip donors the caller excludes or that are behind, and are size-bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads the `typing` form of rpc_* hints)

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging import averager as averager_module
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from peers.allreduce import ExactAllReduceRunner, PartCheck, PartReduce
from peers.auth import RunAuth
from peers.wirecodec import PartCodec
from proto import ProtoError, decode_ticket

StateProvider = Callable[[], tuple[bytes, Sequence[torch.Tensor]]]


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


def round_group_bits(
    round_index: int, codec_name: str | None = None, subset: Sequence[int] | None = None
) -> str:
    """Group-key bits that put only peers at the same outer step into the same matchmaking bucket.

    With a codec, 16 more bits from a hash of its name: peers whose parts would not decode for each
    other look for groups under different keys. With a subset of the tensors (one fragment), the hash
    covers its indices too: only peers averaging the very same tensors meet. A full, uncompressed round
    keeps the plain 32 bits.
    """
    bits = format(round_index % 2**32, "032b")
    if codec_name is None and subset is None:
        return bits
    name = f"dilocod.codec.{codec_name}"
    if subset is not None:
        name += ".tensors." + ",".join(str(i) for i in subset)
    tag = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")
    return bits + format(tag, "016b")


class BanAwareMatchmaking(Matchmaking):
    """Matchmaking that neither accepts followers nor follows leaders this peer has banned."""

    banned: frozenset[PeerID] = frozenset()
    auth: RunAuth | None = None  # the run key: set in the averager process (RunAverager.run)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Group keys are set per round from the outer step (`round_group_bits`); hivemind's own re-bucketing
        # after a group assembles is not used, and it fails when a group is larger than this peer's target
        # size (an auxiliary reducer can make it so).
        self.group_key_manager.update_key_on_group_assembled = _keep_group_key  # type: ignore[method-assign]

    def _check_reasons_to_reject(self, request: Any, context: Any) -> Any:
        if context.remote_id in self.banned:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        if self.auth is not None and not self.auth.admits_member(
            context.remote_id.to_bytes(), gathered_proof(MSGPackSerializer, request.gather)
        ):
            _warn_once(f"refused peer {context.remote_id} into a group: it holds no valid run key")
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


class RunAverager(DecentralizedAverager):
    def __init__(
        self,
        *args: Any,
        state_provider: StateProvider | None = None,
        reduce_part: PartReduce | None = None,
        check_part: PartCheck | None = None,
        codec: PartCodec | None = None,
        corrupt_reductions: bool = False,
        auth: RunAuth | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before super().__init__ forks: the averager process inherits them.
        self._auth = auth
        self._key_holders: set[PeerID] = set()  # peers that proved the run key (rpc_present_run_key)
        self._state_provider = state_provider
        self._reduce_part, self._check_part, self._corrupt = reduce_part, check_part, corrupt_reductions
        self._codec = codec
        self._subset: list[int] | None = None  # which tensors the next round averages (None: all)
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # Runs in the averager process: hivemind builds its Matchmaking by this module-level name.
        averager_module.Matchmaking = BanAwareMatchmaking  # type: ignore[misc]
        BanAwareMatchmaking.auth = self._auth
        super().run()

    def step(self, gather: Any = None, **kwargs: Any) -> Any:
        """Every member's gathered data is [ticket, run-key proof]; see `gathered_proof`."""
        proof = self._auth.member_proof(self.peer_id.to_bytes()) if self._auth is not None else b""
        return super().step(gather=[gather, proof], **kwargs)

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

    # ---- host side ----------------------------------------------------------------------------------
    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        """Called (in the host) when a peer downloads our state."""
        if self._state_provider is None:
            raise RuntimeError("this peer does not share state")
        meta, tensors = self._state_provider()
        return meta, tensors, None

    def download_state(
        self, *, exclude: Sequence[str], min_step: int, max_elements: int, timeout: float
    ) -> Any:
        future: MPFuture = MPFuture()
        kwargs = dict(future=future, exclude=list(exclude), min_step=min_step, max_elements=max_elements)
        self._outer_pipe.send(("_download_state", [], dict(kwargs, timeout=timeout)))
        return future

    # ---- averager process ----------------------------------------------------------------------------
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            self._check_members(group_info)
            bandwidths, modes, tickets = _decode_gathered(self.serializer, group_info.gathered)
            weights = agree_weights(tickets, modes, [peer.to_base58() for peer in group_info.peer_ids])
            if not any(weights):
                raise AllreduceException("no member of the group holds a valid ticket")
            # Only trusted members reduce: a member the group gave weight 0 (out of step, or banned by most)
            # would otherwise still average a share of everybody's parts. Auxiliary reducers keep theirs.
            download = [
                bw if mode == AveragingMode.AUX or (mode != AveragingMode.CLIENT and weight > 0) else 0.0
                for bw, mode, weight in zip(bandwidths, modes, weights)
            ]
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
                    chosen, group_info, modes, weights, peer_fractions=fractions, **kwargs
                )
            my_index = group_info.peer_ids.index(self.peer_id)
            return dict(
                peers=[peer.to_base58() for peer in group_info.peer_ids],
                weights=list(weights),
                my_weight=weights[my_index],
                failed_size=runner.failed_size,
                screened=runner.screened_parts,
                faulty=sorted(peer.to_base58() for peer in runner.faulty_senders),
                rejected_reducers=sorted(peer.to_base58() for peer in runner.rejected_reducers),
                bytes_sent=runner.bytes_sent,
                bytes_received=runner.bytes_received,
                allreduce_seconds=time.monotonic() - started,
            )
        except AllreduceException:
            raise
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
            codec=self._codec,
            corrupt=self._corrupt,
            **kwargs,
        )
        self._running_groups[group_info.group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise AllreduceException("an auxiliary reducer received averaged tensors")
            return runner
        results = [averaged async for averaged in runner]
        if runner.failed_size == 0:  # only a complete result replaces our inputs
            async for tensor, averaged in azip(as_aiter(*tensors), as_aiter(*results)):
                tensor.copy_(averaged)
        return runner

    # ---- state downloads are for the run's peers only ------------------------------------------------
    async def rpc_present_run_key(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> averaging_pb2.MessageFromLeader:
        """A peer about to download our state proves its run key first (a download request carries nothing)."""
        if self._auth is not None and self._auth.admits_member(context.remote_id.to_bytes(), request.gather):
            if len(self._key_holders) > 4096:
                self._key_holders.clear()
            self._key_holders.add(context.remote_id)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        auth = self._auth
        if auth is not None:
            peer = context.remote_id
            admitted = (
                peer in self._key_holders
                if auth.secret is not None
                else auth.admits_member(peer.to_bytes(), None)
            )
            if not admitted:
                _warn_once(f"refused a state download to peer {peer}: it holds no valid run key")
                return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _download_state(
        self, future: MPFuture, exclude: list[str], min_step: int, max_elements: int, timeout: float
    ) -> None:
        try:
            donors = await self._donors(set(exclude), min_step)
            for donor, priority in donors:
                try:
                    meta, tensors = await asyncio.wait_for(self._download_from(donor, max_elements), timeout)
                except Exception as e:
                    self._log_donor_failure(donor, e)
                    continue
                future.set_result((donor.to_base58(), priority, meta, tensors))
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _donors(self, exclude: set[str], min_step: int) -> list[tuple[PeerID, float]]:
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = await self.dht.get(key, latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        donors = []
        for raw_peer, item in entries.items():
            try:
                peer = PeerID(raw_peer)
            except Exception:
                continue
            value = item.value if isinstance(item, ValueWithExpiration) else None
            if not isinstance(value, int | float) or not np.isfinite(value) or value < min_step:
                continue
            if peer == self.peer_id or peer.to_base58() in exclude:
                continue
            donors.append((peer, float(value)))
        random.shuffle(donors)  # equal claims are tried in random order; the caller verifies content
        donors.sort(key=lambda pair: pair[1], reverse=True)
        return donors

    async def _download_from(self, donor: PeerID, max_elements: int) -> tuple[bytes, list[torch.Tensor]]:
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        if self._auth is not None and self._auth.secret is not None:
            proof = self._auth.member_proof(self.peer_id.to_bytes())
            await stub.rpc_present_run_key(
                averaging_pb2.JoinRequest(gather=proof), timeout=self.request_timeout
            )
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        meta: bytes | None = None
        parts: list[Any] = []
        tensors: list[torch.Tensor] = []
        elements = 0
        async for message in aiter_with_timeout(stream, timeout=self.request_timeout * 10):
            if message.metadata and meta is None:
                meta = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                elements += tensors[-1].numel()
                parts = []
            parts.append(message.tensor_part)
            if elements > max_elements or len(parts) > 1_000_000:
                raise ValueError("donor sent more data than our state can hold")
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not isinstance(meta, bytes):
            raise ValueError("donor sent no state metadata")
        return meta, tensors

    def _log_donor_failure(self, donor: PeerID, error: BaseException) -> None:
        from hivemind.utils import get_logger

        get_logger(__name__).info(f"state download from {donor} failed: {error!r}")


async def _keep_group_key(_group_info: GroupInfo) -> None:
    return None


def _log() -> Any:
    from hivemind.utils import get_logger

    return get_logger(__name__)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A refusal is worth one line per peer and reason: a stranger may keep asking."""
    if message in _warned:
        return
    if len(_warned) > 4096:
        _warned.clear()
    _warned.add(message)
    _log().warning(message)


def _unwrap_user(serializer: Any, user_bytes: Any) -> tuple[Any, Any]:
    """A member's own gathered data, [ticket bytes, run-key proof] (see `RunAverager.step`)."""
    user = serializer.loads(user_bytes)
    if not isinstance(user, list | tuple) or len(user) != 2:
        return None, None
    return user[0], user[1]


def gathered_proof(serializer: Any, blob: Any) -> bytes | None:
    """The run-key proof in one member's gathered data, or None when it has none (never raises)."""
    try:
        _bandwidth, _mode, user_bytes = serializer.loads(blob)
        proof = _unwrap_user(serializer, user_bytes)[1]
    except Exception:
        return None
    return proof if isinstance(proof, bytes) else None


def _decode_gathered(
    serializer: Any, gathered: Sequence[bytes]
) -> tuple[list[float | None], list[AveragingMode], list[dict[str, Any] | None]]:
    """Each member's (bandwidth, mode, ticket); anything malformed becomes (None, CLIENT, None)."""
    bandwidths: list[float | None] = []
    modes: list[AveragingMode] = []
    tickets: list[dict[str, Any] | None] = []
    for blob in gathered:
        bandwidth, mode, ticket = None, AveragingMode.CLIENT, None
        try:
            raw_bandwidth, raw_mode, user_bytes = serializer.loads(blob)
            mode = AveragingMode(raw_mode)
            if isinstance(raw_bandwidth, int | float) and np.isfinite(raw_bandwidth) and raw_bandwidth >= 0:
                bandwidth = float(raw_bandwidth)
            ticket = decode_ticket(_unwrap_user(serializer, user_bytes)[0])
        except (ProtoError, Exception):
            pass
        bandwidths.append(bandwidth)
        modes.append(mode)
        tickets.append(ticket)
    return bandwidths, modes, tickets


def agree_weights(
    tickets: Sequence[dict[str, Any] | None],
    modes: Sequence[AveragingMode],
    peer_ids: Sequence[str] | None = None,
) -> list[float]:
    """Weight 1 for contributors whose (outer step, θ hash, size) is the group's most common; else 0.

    Every member runs this on the same gathered data, so all reach the same answer. Ties go to the
    smallest (step, hash) so that the choice does not depend on who computes it. Then a member that
    more than half of those contributors ban (tickets list their bans) loses its weight too: one
    peer's ban list alone never excludes anybody, but a liar most of the group caught does not count.
    """
    weights = _majority_weights(tickets, modes)
    if peer_ids is None:
        return weights
    voters = [t for t, w in zip(tickets, weights) if w > 0 and t is not None]
    votes = Counter(banned for t in voters for banned in set(t.get("bans") or ()))
    return [0.0 if votes[peer] * 2 > len(voters) else w for peer, w in zip(peer_ids, weights)]


def _majority_weights(
    tickets: Sequence[dict[str, Any] | None], modes: Sequence[AveragingMode]
) -> list[float]:
    keys = [
        (t["outer_step"], t["global_sha256"], t["num_params"])
        if t is not None and t["role"] == "peer" and mode != AveragingMode.AUX
        else None
        for t, mode in zip(tickets, modes)
    ]
    counts = Counter(key for key in keys if key is not None)
    if not counts:
        return [0.0] * len(keys)
    top = max(counts.values())
    majority = min(key for key, count in counts.items() if count == top)
    return [1.0 if key == majority else 0.0 for key in keys]
