"""A joiner's partial copy (dilocod/node/shardfetch.py): which training shards a chunk needs, which
leases are ready, and random windows drawn only from the shards it holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilocod.data.errors import DataError
from dilocod.data.localcopy import missing_train_shards, open_dataset
from dilocod.data.schedule import Grant
from dilocod.data.shards import TokenStream
from dilocod.node.shardfetch import LazyShards, server_maddrs
from dilocod.observability.peerstate import ShardProgress
from dilocod.trainer.batches import PresentSampler


def test_a_partial_copy_opens_and_knows_which_shards_a_chunk_needs(partial_dataset: Path) -> None:
    index = open_dataset(partial_dataset, partial=True)
    with pytest.raises(DataError, match="missing"):
        open_dataset(partial_dataset)  # a full open still wants every file
    assert missing_train_shards(partial_dataset, index) == [1, 2]
    lazy = LazyShards(partial_dataset, index, ShardProgress())
    assert not lazy.complete and lazy.present == set(range(len(index.train.shards))) - {1, 2}
    assert list(lazy.shards_of(0, 4096)) == [0] and list(lazy.shards_of(4000, 4200)) == [0, 1]
    first, second = Grant(0, 0, 0, 4096, 0), Grant(0, 1, 4096, 8192, 0)
    assert lazy.ready(first) and not lazy.ready(second)
    assert lazy.needed([second, first]) == [1, 2]
    assert lazy.present_ranges()[0] == (0, 4096) and (4096, 8192) not in lazy.present_ranges()


def test_random_windows_come_only_from_the_shards_held(partial_dataset: Path) -> None:
    index = open_dataset(partial_dataset, partial=True)
    lazy = LazyShards(partial_dataset, index, ShardProgress())
    stream = TokenStream(partial_dataset, index, "train")
    sampler = PresentSampler(stream, lazy.present_ranges, seed=1, peer_key="p", batch_size=16, seq_len=32)
    x, y = sampler.batch(0)  # would raise on a missing shard
    assert x.shape == (16, 32) and bool((x[:, 1:] == y[:, :-1]).all())
    assert bool((sampler.batch(0)[0] == x).all())  # a pure function of the position
    empty = PresentSampler(stream, lambda: [], seed=1, peer_key="p", batch_size=2, seq_len=32)
    with pytest.raises(DataError, match="no training shard"):
        empty.batch(0)


def test_shards_are_asked_of_public_peers_first_then_of_the_peers_given() -> None:
    records = [
        {"peer_id": "A", "reachability": "public", "maddrs": ["/ip4/10.0.0.1/tcp/1"]},
        {"peer_id": "B", "reachability": "private", "maddrs": ["/ip4/10.0.0.2/tcp/1"]},
        {"peer_id": "me", "reachability": "public", "maddrs": ["/ip4/10.0.0.3/tcp/1"]},
        {"peer_id": "C", "reachability": "public", "maddrs": ["/ip4/1.2.3.4/tcp/5/p2p-circuit", "/ip4/10.0.0.4/tcp/1/p2p/C"]},
    ]  # fmt: skip
    boot = "/ip4/10.0.0.9/tcp/1/p2p/BOOT"
    assert server_maddrs(records, "me", [boot]) == [
        "/ip4/10.0.0.1/tcp/1/p2p/A", "/ip4/10.0.0.4/tcp/1/p2p/C", boot,
    ]  # fmt: skip
