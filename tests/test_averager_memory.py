"""What a round costs the averager process in memory, with real DHTs, p2pd daemons and averager processes.

The averager process reads our Δ from the shared buffers and writes the group's average back into them.
Each tensor's average goes in as soon as all its parts are in: the process never holds the whole model's
averages beside the buffers (one more copy of the model at every round's peak, peers/averager.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from proto import encode_ticket
from tests.averagers import started_averagers

SHAPES = [(1 << 20,)] * 32  # 32 tensors of 4 MiB: 128 MiB of fp32, like a model's many layers
NUM = sum(torch.Size(s).numel() for s in SHAPES)
MODEL_MB = NUM * 4 / 2**20


def ticket() -> bytes:
    return encode_ticket(
        {
            "outer_step": 0,
            "global_sha256": "a" * 64,
            "num_params": NUM,
            "role": "peer",
            "tokens": 1000,
            "tokens_per_second": 100.0,
            "train_seconds": 10.0,
            "manifest_hash": "ab" * 32,
        }  # fmt: skip
    )


@pytest.fixture(scope="module")
def pair() -> Iterator[list[GroupAverager]]:
    options = AveragingSettings(target_group_size=2, min_matchmaking_time=2.0, matchmaking_timeout=20.0)
    # The first member only sends and receives (as behind NAT): what it holds is its own buffers and the
    # averages, not another member's parts to reduce.
    members = [dataclasses.replace(options, mode="client"), options]
    with started_averagers("avgmemory", [torch.zeros(s) for s in SHAPES], members) as groups:
        yield groups


def status_mb(pid: int, field: str) -> float:
    """A memory figure of /proc/<pid>/status (VmRSS: resident now, VmHWM: the peak), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def test_a_round_costs_a_senders_averager_process_one_model(pair: list[GroupAverager]) -> None:
    gen = torch.Generator().manual_seed(5)
    inputs = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in pair]
    pids = [group.averager.pid for group in pair]
    assert all(pid is not None for pid in pids)
    before = [status_mb(pid, "VmRSS") for pid in pids]  # type: ignore[arg-type]
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from what it holds now

    async def together() -> list[RoundOutcome]:
        return list(await asyncio.gather(*(g.average(1, ticket(), x) for g, x in zip(pair, inputs))))

    outcomes = asyncio.run(together())
    assert all(o.averaged is not None for o in outcomes), [o.error for o in outcomes]
    expected = [(a + b) / 2 for a, b in zip(*inputs)]
    assert all(torch.allclose(x, y) for x, y in zip(outcomes[0].averaged or [], expected))
    grown = [status_mb(pid, "VmHWM") - mb for pid, mb in zip(pids, before)]  # type: ignore[arg-type]
    # The sender's averager: the shared buffers it reads and writes (one model, resident in it too) and
    # a part or a tensor in flight. Collecting the whole model's averages before writing them took one more.
    assert grown[0] < 1.5 * MODEL_MB, (grown, MODEL_MB)
