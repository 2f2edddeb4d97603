"""Streaming DiLoCo's fragments and its mixing rule. Pure tensor code.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
arXiv:2501.18512) syncs the parameters one fragment at a time, in staggered turns, and mixes each
fragment's new θ_global into the working copy instead of replacing it.

The split must be the same on every peer of a run (peers average a fragment's tensors with each other),
so it depends on nothing but the tensors' sizes in model order: whole tensors, the largest first, each
to the fragment that holds the fewest elements so far (ties: the lower fragment index); within a
fragment, tensors stay in model order. For a transformer this spreads every fragment across the depth of
the model, like the paper's "strided" fragments, and balances the bytes each turn puts on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Tensor indices of each of `count` fragments (every one non-empty, each sorted)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {count} fragments")
    totals = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        # An empty fragment first: with a very uneven split, a tiny tensor must still get a fragment.
        target = min(range(count), key=lambda f: (bool(members[f]), totals[f], f))
        members[target].append(index)
        totals[target] += sizes[index]
    return [sorted(m) for m in members]


def fragment_of(outer_step: int, count: int) -> int:
    """The fragment the round at `outer_step` syncs: turns go 0, 1, …, count − 1, 0, …"""
    return outer_step % count


@torch.no_grad()
def mix(local: torch.Tensor, new_global: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·local + (1 − α)·global: how much of its own recent progress a peer keeps in a synced fragment.

    α = 0 replaces the working fragment by θ_global exactly (as plain DiLoCo does with every
    parameter); α = 1 keeps the working copy as it is. The result is local state (the working copy),
    which need not be bit-identical across peers; θ_global never goes through this.
    """
    if alpha == 0:
        return new_global.clone()
    if alpha == 1:
        return local.clone()
    return torch.add(torch.mul(local, alpha), torch.mul(new_global, 1.0 - alpha))
