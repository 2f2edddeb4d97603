"""Integration: a peer training on 2 local devices (gloo on CPU) in a real swarm, next to an ordinary
peer. The node is one peer to the run; its worker process lives and dies with it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import Proc, Swarm, get_json, get_text, wait_for

pytestmark = pytest.mark.integration

WORKER_MODULE = "dilocod.trainer.worker"


def worker_pids(node: Proc) -> list[int]:
    """Live local workers of `node`: processes in its process group running the worker module."""
    assert node.popen is not None
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if state != "Z" and pgrp == node.popen.pid and WORKER_MODULE.encode() in cmdline:
            found.append(int(entry.name))
    return found


def no_workers_left(pids: list[int]) -> bool:
    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    return all(gone(pid) for pid in pids)


def metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_two_device_node_is_one_peer_and_its_worker_dies_with_it(
    swarm: Callable[..., Swarm], tmp_path: Path
) -> None:
    # No auxiliary reducer: a peer that met only the bootstrap would advance "alone" and leave the other
    # re-syncing behind it; without one, the two peers only ever advance together.
    s = swarm(0, bootstrap=False)
    boot_dir = tmp_path / "boot"  # the run's chunk book (chunks.json) is kept there
    s.start_bootstrap("dilocod", "--no-reduce", "--run-dir", str(boot_dir))
    node = s.add_peer("trainer.devices=2")  # what `dilocod join --devices 2` sets
    s.add_peer()  # an ordinary one-device peer
    first = s.wait_serving(node)
    assert first["devices"] == 2
    workers = wait_for("the node's worker", lambda: worker_pids(node), 30)
    assert len(workers) == 1

    statuses = s.wait_all_at(2, timeout=120)
    node_status, plain_status = statuses
    # Both peers agree on θ_global after every round they both completed.
    ours = {e["outer_step"]: e["global_sha256"] for e in node_status["rounds"] if e["result"] == "ok"}
    theirs = {e["outer_step"]: e["global_sha256"] for e in plain_status["rounds"] if e["result"] == "ok"}
    shared = ours.keys() & theirs.keys()
    assert shared, (node_status["rounds"], plain_status["rounds"])
    assert all(ours[step] == theirs[step] for step in shared)
    assert node_status["group_size"] == 2  # the node counts as one member, not two
    assert node_status["mfu"] is None  # CPU: no known peak

    # Twice the tokens per inner step: both ranks' batches count.
    text = get_text(f"http://127.0.0.1:{node.http_port}/metrics")
    per_step = metric(text, "dilocod_tokens_total") / metric(text, "dilocod_inner_steps_total")
    assert per_step == 2 * 8 * 64
    assert "dilocod_mfu NaN" in text

    # One DHT identity: the run lists the node once, next to the other peer.
    assert s.bootstrap is not None
    run_url = f"http://127.0.0.1:{s.bootstrap.http_port}/api/run"
    run = wait_for(
        "the bootstrap to list 2 peers", lambda: (r := get_json(run_url)["peers"]) and len(r) == 2 and r, 30
    )
    assert sorted(p["peer_id"] for p in run) == sorted([node_status["peer_id"], plain_status["peer_id"]])

    # The node's whole batch, both ranks', comes from its chunk leases.
    before_stop = node.status()
    assert before_stop["data_schedule"]["unscheduled_batches"] == 0, before_stop["data_schedule"]

    # SIGTERM: a graceful stop that also stops the worker.
    node.signal(signal.SIGTERM)
    assert node.wait(timeout=40) == 0
    assert no_workers_left(workers)

    # Restart (resumes its checkpoint and hands the restored state to a new worker), then SIGKILL the
    # node alone: no cleanup code runs, and the worker must still go.
    node.start()
    resumed = s.wait_serving(node)
    assert resumed["devices"] == 2 and "resumed from checkpoint" in node.output()
    workers = wait_for("the restarted node's worker", lambda: worker_pids(node), 30)
    wait_for("the node to train again", lambda: node.status()["inner_step"] > resumed["inner_step"], 60)
    node.signal(signal.SIGKILL)
    node.wait(timeout=10)
    started = time.monotonic()
    wait_for("the worker to exit after its node was killed", lambda: no_workers_left(workers), 10, 0.1)
    assert time.monotonic() - started < 10

    # The bootstrap's book: the parts recorded as the node's cover every token both its ranks trained
    # (its final report came with the graceful stop), and no part of a chunk was trained twice.
    s.bootstrap.stop()
    book = json.loads((boot_dir / "chunks.json").read_text())
    mine = 0
    for raw in book["epochs"].values():
        for chunk, parts in raw["segments"].items():
            ordered = sorted(parts, key=lambda p: p[1])
            assert [lo for _, lo, _ in ordered] == [0, *[hi for _, _, hi in ordered[:-1]]], (chunk, parts)
            mine += sum(hi - lo for peer, lo, hi in parts if peer == node_status["peer_id"])
    assert before_stop["tokens_trained"] <= mine, (before_stop["tokens_trained"], mine)
