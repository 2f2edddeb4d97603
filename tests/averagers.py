"""Real averagers for in-process tests of the networking layer: DHT nodes with their p2pd daemons and
one averager process each, started in order and always stopped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from peers.group import AveragingSettings, GroupAverager
from peers.node import Node, NodeSettings


@contextmanager
def started_averagers(
    run_id: str, template: Sequence[torch.Tensor], options: Sequence[AveragingSettings]
) -> Iterator[list[GroupAverager]]:
    """One node and averager per entry of `options` (each member's own), on loopback, joined through the
    first node; every process is stopped on exit, however the test ended."""
    nodes: list[Node] = []
    groups: list[GroupAverager] = []
    try:
        for _ in options:
            initial = tuple(nodes[0].visible_maddrs()[:1]) if nodes else ()
            node = Node(NodeSettings(run_id=run_id, initial_peers=initial, host="127.0.0.1"))
            node.start()
            nodes.append(node)
        for node, member in zip(nodes, options, strict=True):
            averager = GroupAverager(node, template, member, state_provider=None)
            averager.start()
            groups.append(averager)
        yield groups
    finally:
        for averager in groups:
            averager.stop()
        for node in nodes:
            node.stop()
