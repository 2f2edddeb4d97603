"""Our state, for the run's peers only: serving it to peers that hold the run key, and downloading it whole
from one donor at a time (a re-syncing peer downloads in parts from several, peers/state/download.py, and
comes here only when no donor serves parts; `dilocod export --from` downloads here).

A joining or re-syncing peer downloads the state (metadata and tensors) from another peer. The
averager here (a base class of `RunAverager`, in its process like hivemind's) adds to hivemind's download:
- a peer proves its run key (`rpc_present_run_key`) before we serve it our state: a download request
  carries nothing a proof could ride on;
- a download skips donors the caller excludes or that are behind, tries the most advanced first (equal
  claims in random order; the caller verifies what it gets), and is size-bounded;
- our declaration as a donor (every `declare_state_period`) is awaited to its end: hivemind's own loop
  starts each as a task nobody awaits, and on a loaded machine a store that outlasts its period then
  ends in an unretrieved TimeoutError, an ERROR in the log (16 of them in 4 minutes of 32 peers on 2
  cores) for a declaration the next one replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads the `typing` form of rpc_* hints)

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from peers.auth import RunAuth
from peers.membership import warn_once
from peers.state.fetch import forgetful_state_thread

StateProvider = Callable[[], tuple[bytes, Sequence[torch.Tensor]]]

log = logging.getLogger("peers.state.donors")


class StateDonors(DecentralizedAverager):
    """hivemind's averager with state downloads for run-key holders only (see the module's docstring).

    hivemind registers every `rpc_*` method of the servicer's class, inherited ones included, so
    `RunAverager` serves these two RPCs as its own.
    """

    def __init__(
        self,
        *args: Any,
        state_provider: StateProvider | None = None,
        auth: RunAuth | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before super().__init__ forks: the averager process inherits them.
        self._auth = auth
        self._key_holders: set[PeerID] = set()  # peers that proved the run key (rpc_present_run_key)
        self._state_provider = state_provider
        self._downloads: set[asyncio.Task[Any]] = set()  # running downloads (see `_download_state`)
        with forgetful_state_thread():  # keeps no snapshot once served (peers/state/fetch.py)
            super().__init__(*args, **kwargs)

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
                warn_once(f"refused a state download to peer {peer}: it holds no valid run key")
                return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _download_state(
        self, future: MPFuture, exclude: list[str], min_step: int, max_elements: int, timeout: float
    ) -> None:
        # hivemind's control loop starts this as a task it keeps no reference to, and the DHT's answer it
        # awaits (an MPFuture) is held weakly: the garbage collector could close it mid-download. Its
        # `finally` then ran inside whatever code the collection interrupted, and when that code was
        # sending another MPFuture's result (as hivemind's `_step` does at once), the second send waited
        # for the cross-process lock the first one held: the averager process hung for good.
        task = asyncio.current_task()
        if task is not None:
            self._downloads.add(task)
            task.add_done_callback(self._downloads.discard)
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
                tensors.append(_tensor_from_parts(parts, len(tensors)))
                elements += tensors[-1].numel()
                parts = []
            parts.append(message.tensor_part)
            if elements > max_elements or len(parts) > 1_000_000:
                raise ValueError("donor sent more data than our state can hold")
        if parts:
            tensors.append(_tensor_from_parts(parts, len(tensors)))
        if not isinstance(meta, bytes):
            raise ValueError("donor sent no state metadata")
        return meta, tensors

    async def _declare_for_download_periodically(self) -> None:
        """Declare us a donor under the run's averagers key once a period, or at once when sharing is
        switched (off: one declaration of None withdraws us)."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        was_sharing = self.allow_state_sharing
        pending: set[asyncio.Task[None]] = set()  # held here: asyncio keeps tasks only weakly
        while True:
            expiration = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or was_sharing:
                value = self.state_sharing_priority if self.allow_state_sharing else None
                store = self.dht.store(
                    key,
                    subkey=self.peer_id.to_bytes(),
                    value=value,
                    expiration_time=expiration,
                    return_future=True,
                )
                task = asyncio.create_task(declared(store, expiration))
                pending.add(task)
                task.add_done_callback(pending.discard)
                was_sharing = self.allow_state_sharing
            self._state_updated.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._state_updated.wait(), timeout=max(0.0, expiration - get_dht_time())
                )

    def _log_donor_failure(self, donor: PeerID, error: BaseException) -> None:
        from hivemind.utils import get_logger

        get_logger(__name__).info(f"state download from {donor} failed: {error!r}")


def _tensor_from_parts(parts: list[Any], index: int) -> torch.Tensor:
    """One tensor of a donor's stream; its first part says how many parts it has (a stream that lost some
    would otherwise fail later with a bare shape error)."""
    if parts[0].chunks and len(parts) != parts[0].chunks:
        raise ValueError(
            f"donor's stream broke off tensor {index}: {len(parts)} of its {parts[0].chunks} parts"
        )
    return deserialize_torch_tensor(combine_from_streaming(parts))


async def declared(store: MPFuture, expiration: float) -> None:
    """Wait for one declaration until it would expire anyway; a failed or late one is replaced by the next."""
    try:
        await asyncio.wait_for(store, timeout=max(0.0, expiration - get_dht_time()))
    except Exception as e:
        log.debug("our declaration as a state donor did not land before it expired: %r", e)
