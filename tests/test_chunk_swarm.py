"""The run's chunk schedule through the CLI: 4 peers train the built-in dataset's chunks, one is killed and
restarted mid-epoch, and the bootstrap's record shows no part of any chunk trained twice, with every
peer's trained tokens covered by the chunk parts recorded as its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness import FAST, Swarm, get_json

pytestmark = pytest.mark.integration

CHUNK_TOKENS = 8192  # FAST trains 8 × 64 tokens a step: a chunk lasts ~16 steps, about 3 rounds
SEQ_LEN = 64


def segments_by_chunk(book: dict[str, Any]) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    found: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for epoch, raw in book["epochs"].items():
        for chunk, parts in raw["segments"].items():
            found[(int(epoch), int(chunk))] = [(p, lo, hi) for p, lo, hi in parts]
    return found


def test_four_peers_train_each_chunk_part_once_through_a_kill_and_restart(tmp_path: Path) -> None:
    s = Swarm(tmp_path, overrides=(*FAST, f"data.chunk_tokens={CHUNK_TOKENS}"))
    boot_dir = tmp_path / "boot"
    try:
        s.start_bootstrap("dilocod", "--run-dir", str(boot_dir))
        assert s.bootstrap is not None
        peers = [s.add_peer() for _ in range(4)]
        run_url = f"http://127.0.0.1:{s.bootstrap.http_port}/api/run"
        try:
            s.wait_all_at(2, timeout=240)
            victim = peers[3]
            before = victim.status()
            held = [(lease["epoch"], lease["chunk"]) for lease in before["data_schedule"]["leases"]]
            victim.reap()  # SIGKILL: no goodbye, no final report
            victim.start()  # same run dir: same identity, its checkpoint's leases
            s.wait_all_at(before["outer_step"] + 3, timeout=240)
            after = victim.status()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}") from None
        # The restarted peer resumed a lease it held before the kill (a lease outlives a restart).
        assert victim.run_dir is not None and after["data_schedule"]["error"] is None
        first = (victim.run_dir / "dilocod.log").read_text().split("chunk leases: ")[-1].splitlines()[0]
        assert any(f"epoch {e} chunk {c} from" in first for e, c in held), (held, first)
        # Graceful stops report the last offsets; then the bootstrap saves its book.
        finals = {}
        for peer in peers:
            finals[peer.name] = peer.status()
            peer.stop()
        dataset = get_json(run_url)["dataset"]
        s.bootstrap.stop()
    finally:
        s.close()

    book = json.loads((boot_dir / "chunks.json").read_text())
    assert dataset["chunks_total"] == -(-book["train_tokens"] // CHUNK_TOKENS)
    assert dataset["epoch"] == 0 and dataset["chunks_trained"] >= 4, dataset
    assert dataset["epoch_fraction"] == pytest.approx(dataset["tokens_trained"] / book["train_tokens"])
    parts = segments_by_chunk(book)
    mine: dict[str, int] = {}
    for (epoch, chunk), found in parts.items():
        ordered = sorted(found, key=lambda p: p[1])
        # No token of a chunk trained twice: the parts follow each other from the chunk's start.
        assert [lo for _, lo, _ in ordered] == [0, *[hi for _, _, hi in ordered[:-1]]], (epoch, chunk, found)
        for peer, lo, hi in found:
            mine[peer] = mine.get(peer, 0) + hi - lo
    assert sum(mine.values()) == book["tokens_trained"]
    for name, status in finals.items():
        schedule = status["data_schedule"]
        assert schedule["error"] is None and schedule["unscheduled_batches"] == 0, (name, schedule)
        # Every token the peer trained lies in a chunk part recorded as its own (the parts also hold the
        # short tails of its chunks, at most one window each).
        assert status["tokens_trained"] <= mine.get(status["peer_id"], 0), (
            name,
            status["tokens_trained"],
            mine,
        )
    assert len(mine) == 4
