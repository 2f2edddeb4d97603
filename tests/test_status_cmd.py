"""`dilocod status` without a swarm: the table from given records, and its errors.

tests/test_observability_live.py runs it against a live swarm.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dilocod.cli import main
from dilocod.observability.http import HttpServer
from dilocod.observability.metrics import Metrics
from dilocod.observability.statuscmd import normalize_url, render, run_status
from tests.harness import free_port


def record(peer_id: str, **fields: Any) -> dict[str, Any]:
    base = {
        "peer_id": peer_id, "run_id": "r1", "role": "peer", "reachability": "public", "outer_step": 4,
        "inner_step": 80, "loss": 3.25, "eval_loss": None, "tokens_per_second": 1500.0, "global_sha256": "ab" * 32,
        "group_size": 3, "alone": False, "last_round_seconds": 2.5, "rounds_ok": 4, "rounds_failed": 1,
        "time": 1000.0, "version": "0.1.0", "maddrs": [], "tokens_trained": 1000, "tokens_contributed": 950,
        "contributing": True,
    }  # fmt: skip
    base.update(fields)
    return base


def test_render_lists_every_peer_with_its_numbers() -> None:
    records = [
        record("12D3KooWAAAAAAAAAAAAAAAAAAAApeerone1"),
        record(
            "12D3KooWBBBBBBBBBBBBBBBBBBBBpeertwo2", reachability="private", outer_step=3, loss=float("nan")
        ),
        record(
            "12D3KooWCCCCCCCCCCCCCCCCCCCCpeerthr3", time=900.0, alone=True, group_size=1,
            tokens_contributed=100, contributing=False,
        ),
    ]  # fmt: skip
    status = {
        "peer_id": "12D3KooWBBBBBBBBBBBBBBBBBBBBpeertwo2", "role": "peer", "run_id": "r1",
        "not_contributing_reason": "behind the run's clock by 4.0s",
    }  # fmt: skip
    text = render(status, records, "http://x:1", now=1002.0)
    lines = text.splitlines()
    assert lines[0].startswith("run r1 · via peer …BBpeertwo2 (http://x:1) · 3 peers · 4,500 tokens/s")
    assert "outer step 4 (slowest 3)" in lines[0] and "67% of tokens reached θ_global" in lines[0]
    assert lines[2].split()[:3] == ["PEER", "ROLE", "REACH"]
    rows = {line.split()[0]: line for line in lines[3:6]}
    assert set(rows) == {"…AApeerone1", "…BBpeertwo2*", "…CCpeerthr3"}
    assert "relayed" in rows["…BBpeertwo2*"] and "–" in rows["…BBpeertwo2*"]  # NaN loss shows as –
    assert "3.250" in rows["…AApeerone1"] and "1,500" in rows["…AApeerone1"] and "4/1" in rows["…AApeerone1"]
    assert "abababababab" in rows["…AApeerone1"] and "2.5s" in rows["…AApeerone1"]
    assert "1 alone" in rows["…CCpeerthr3"] and "(stale)" in rows["…CCpeerthr3"]
    assert " 95% " in rows["…AApeerone1"] and " 10%! " in rows["…CCpeerthr3"]  # its share; ! not contributing
    assert lines[-2] == "* the node that answered"
    assert lines[-1] == "the node that answered is not contributing: behind the run's clock by 4.0s"
    # Columns line up: numbers are right-aligned under their header.
    end = lines[2].index("OUTER") + len("OUTER") - 1
    assert [line[end] for line in lines[3:6]] == ["4", "3", "4"]


def test_render_flags_a_peer_of_another_manifest() -> None:
    records = [
        record("12D3KooWAAAAAAAAAAAAAAAAAAAApeerone1"),
        record("12D3KooWDDpeerodd4", other_manifest=True),
    ]
    lines = render(
        {"role": "bootstrap", "peer_id": "boot", "run_id": "r1"}, records, "http://x:1"
    ).splitlines()
    rows = {line.split()[0]: line for line in lines[3:5]}
    assert "≠manifest" in rows["…DDpeerodd4"] and "≠manifest" not in rows["…AApeerone1"]
    assert lines[-1].startswith("≠manifest: runs another run manifest than the node that answered")


def test_render_without_peers() -> None:
    text = render({"role": "bootstrap", "peer_id": "boot", "run_id": "r1"}, [], "http://x:1")
    assert "0 peers" in text and "(no live peer records yet)" in text


def test_the_summary_shows_the_runs_progress_through_its_dataset() -> None:
    dataset = {
        "epoch": 1,
        "epoch_fraction": 0.256,
        "tokens_trained": 9,
        "chunks_trained": 13,
        "chunks_total": 11,
    }
    text = render({"role": "bootstrap", "peer_id": "boot", "run_id": "r1"}, [], "http://x:1", dataset=dataset)
    assert "dataset epoch 1 25.6% (13/11 chunks)" in text.splitlines()[0]


def test_normalize_url() -> None:
    assert normalize_url("127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert normalize_url(" https://run.example.org/ ") == "https://run.example.org"


def test_unreachable_node_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    assert main(["status", f"127.0.0.1:{port}"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"dilocod: error: cannot reach http://127.0.0.1:{port}")


def test_bad_interval_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--watch", "--interval", "0"])
    assert exited.value.code == 2 and "out of range" in capsys.readouterr().err


@pytest.fixture
def fake_node() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HttpServer (no DHT) answering with records the test controls."""
    records: list[dict[str, Any]] = [record("12D3KooWAAAAAAAAAAAAAAAAAAAApeerone1")]
    status = {
        "peer_id": "12D3KooWZZZZZZZZZZZZZZZZZZZZZZpeerme",
        "role": "peer",
        "run_id": "r1",
        **record("x"),
    }
    status["peer_id"] = "12D3KooWZZZZZZZZZZZZZZZZZZZZZZpeerme"
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def run_fn() -> list[dict[str, Any]]:
        return records

    def serve() -> None:
        asyncio.set_event_loop(loop)
        server = HttpServer(Metrics(), lambda: status, run_fn)
        holder["port"] = loop.run_until_complete(server.start("127.0.0.1", 0))
        holder["server"] = server
        started.set()
        loop.run_forever()
        loop.run_until_complete(server.stop())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{holder['port']}", records
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_watch_redraws_and_adds_the_answering_peer(fake_node: tuple[str, list[dict[str, Any]]]) -> None:
    url, records = fake_node
    out = io.StringIO()
    started = time.monotonic()
    assert run_status(url, watch=True, interval=0.2, count=3, out=out) == 0
    assert time.monotonic() - started < 10
    text = out.getvalue()
    assert text.count("run r1 · via peer") == 3
    # The answering peer's own record was not in /api/run yet: it is listed from its status.
    assert text.count("…ZZZZpeerme*") == 3 and text.count("…AApeerone1") == 3
    assert "2 peers" in text
