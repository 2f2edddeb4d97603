"""The dashboard's data: the bounded run history, the run-wide gauges, and the HTTP routes that serve them."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from typing import Any

import pytest

from dilocod.observability.history import PEER_FIELDS, RUN_FIELDS, RunHistory
from dilocod.observability.http import HttpServer
from dilocod.observability.metrics import Metrics


def rec(peer: str, step: int, **fields: Any) -> dict[str, Any]:
    base = {
        "peer_id": peer, "role": "peer", "reachability": "public", "outer_step": step, "inner_step": 5 * step,
        "loss": 4.0 - 0.1 * step, "eval_loss": None, "tokens_per_second": 100.0, "group_size": 2,
        "last_round_seconds": 1.5, "rounds_ok": step, "rounds_failed": 0, "time": 1000.0 + step,
    }  # fmt: skip
    base.update(fields)
    return base


def column(snapshot: dict[str, Any], peer: str, name: str) -> list[Any]:
    i = snapshot["peer_fields"].index(name)
    return [row[i] for row in snapshot["peers"][peer]["samples"]]


def test_samples_follow_progress_not_polls() -> None:
    h = RunHistory()
    for t, step in enumerate([0, 0, 1, 1, 1, 2]):
        h.observe([rec("a", step), rec("b", step, reachability="private")], now=2000.0 + t)
    snap = h.snapshot()
    assert snap["peer_fields"] == list(PEER_FIELDS) and snap["run_fields"] == list(RUN_FIELDS)
    assert column(snap, "a", "outer_step") == [0, 1, 2]  # one sample per change, not per read
    assert column(snap, "a", "loss") == pytest.approx([4.0, 3.9, 3.8])
    assert column(snap, "a", "bytes_sent") == [None, None, None]  # not in the records (yet)
    assert snap["peers"]["b"]["reachability"] == "private"
    # Run samples at most every 5 s: t=0 and t=5.
    assert [row[0] for row in snap["run"]] == [2000.0, 2005.0]
    run = dict(zip(RUN_FIELDS, snap["run"][-1]))
    assert run["peers"] == 2 and run["tokens_per_second"] == 200.0 and run["outer_step"] == 2
    assert run["rounds_ok"] == 4 and run["loss"] == pytest.approx(3.8)
    # A peer that makes no progress is still sampled now and then (its tokens/s may change).
    h.observe([rec("a", 2, tokens_per_second=50.0)], now=2100.0)
    assert column(h.snapshot(), "a", "tokens_per_second")[-1] == 50.0


def test_history_stays_bounded_and_covers_the_whole_run() -> None:
    h = RunHistory(max_samples=50, max_peers=3)
    for step in range(1000):
        h.observe([rec("a", step)], now=float(step * 10))
    steps = column(h.snapshot(), "a", "outer_step")
    assert len(steps) <= 50
    assert steps[0] == 0 and steps[-1] == 999  # thinned, not truncated
    assert steps == sorted(steps)
    assert len(h.snapshot()["run"]) <= 50
    # At most max_peers peers; the one seen longest ago goes first.
    for i, peer in enumerate(["b", "c", "d"]):
        h.observe([rec(peer, 1)], now=20_000.0 + i)
    assert sorted(h.snapshot()["peers"]) == ["b", "c", "d"]


def test_bad_numbers_become_null() -> None:
    h = RunHistory()
    h.observe([rec("a", 1, loss=float("nan"), eval_loss=float("inf"), group_size=True)], now=1.0)
    snap = h.snapshot()
    assert column(snap, "a", "loss") == [None]
    assert column(snap, "a", "eval_loss") == [None]
    assert column(snap, "a", "group_size") == [None]
    json.dumps(snap, allow_nan=False)  # the API answer is strict JSON


def test_run_gauges() -> None:
    m = Metrics()
    m.observe_run([rec("a", 3), rec("b", 5, tokens_per_second=float("nan")), rec("h", 9, role="helper")])
    text = m.render().decode()
    assert "dilocod_run_peers 2.0" in text
    assert "dilocod_run_tokens_per_second 100.0" in text
    assert "dilocod_run_outer_step 5.0" in text
    assert 'dilocod_build_info{version="' in text
    for name in ("dilocod_bytes_sent_total", "dilocod_bytes_received_total", "dilocod_bans_total",
                 "dilocod_rejected_contributions_total", "process_resident_memory_bytes"):  # fmt: skip
        assert f"\n{name} " in text, name


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, "", ""


def test_http_routes_serve_the_dashboard_and_history() -> None:
    async def scenario() -> dict[str, tuple[int, str, str]]:
        history = RunHistory()
        history.observe([rec("a", 1, loss=math.nan)], now=5.0)

        async def run() -> list[dict[str, Any]]:
            return [rec("a", 1, loss=math.nan)]

        server = HttpServer(Metrics(), lambda: {"role": "bootstrap", "x": math.inf}, run, history)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        paths = ["/", "/static/app.js", "/static/style.css", "/static/..%2Fhttp.py", "/static/index.html",
                 "/api/history", "/api/run", "/api/status", "/metrics"]  # fmt: skip
        try:
            answers = await asyncio.gather(
                *(loop.run_in_executor(None, _get, f"http://127.0.0.1:{port}{p}") for p in paths)
            )
        finally:
            await server.stop()
        return dict(zip(paths, answers))

    got = asyncio.run(scenario())
    assert got["/"][0] == 200 and got["/"][1].startswith("text/html")
    page = got["/"][2]
    assert 'src="static/app.js"' in page and 'href="static/style.css"' in page
    assert "http://" not in page.replace('xmlns="http://', "") and "https://" not in page  # no CDN
    for chart in ("loss", "eval", "tps", "peers", "round", "group", "bytes"):
        assert f'id="chart-{chart}"' in page
    assert got["/static/app.js"][0] == 200 and "javascript" in got["/static/app.js"][1]
    assert "api/history" in got["/static/app.js"][2]
    assert got["/static/style.css"][0] == 200
    assert got["/static/..%2Fhttp.py"][0] == 404 and got["/static/index.html"][0] == 404
    history = json.loads(got["/api/history"][2])
    assert history["peers"]["a"]["samples"][0][PEER_FIELDS.index("loss")] is None
    assert json.loads(got["/api/run"][2]) == {
        "peers": [json.loads(got["/api/run"][2])["peers"][0]],
        "dataset": None,
        "sample": None,  # no sampler given: a node without one says so
        "scoring": None,  # a run that does not score contributions
    }
    assert json.loads(got["/api/run"][2])["peers"][0]["loss"] is None
    assert json.loads(got["/api/status"][2])["x"] is None
    assert "dilocod_outer_step" in got["/metrics"][2]
