"""Watching a live 3-peer swarm: `dilocod status`, a real Prometheus server, the dashboard in Chromium.

One swarm (a bootstrap and 3 peers, real processes on loopback) serves every test of this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dilocod.cli import main
from tests.harness import REPO, Swarm, free_port, get_json, get_text, wait_for
from tests.tools import CHROMIUM_ARGS, artifact, need_program, playwright

pytestmark = pytest.mark.integration

GRAFANA = REPO / "configs" / "grafana" / "dilocod.json"


@pytest.fixture(scope="module")
def live(module_swarm: Callable[..., Swarm]) -> Swarm:
    s = module_swarm(3, "trainer.sample_every=2")  # a completion of the run's prompt at outer step 2
    s.wait_all_at(2, timeout=240)
    assert s.bootstrap is not None
    run_url = f"http://127.0.0.1:{s.bootstrap.http_port}/api/run"
    wait_for("the bootstrap to list 3 peers", lambda: len(get_json(run_url)["peers"]) == 3, 60)
    return s


def _peer_ids(s: Swarm) -> list[str]:
    return [str(p.status()["peer_id"]) for p in s.peers]


def _dilocod(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


# ---- dilocod status ----------------------------------------------------------------------------------
def test_status_command_prints_every_peer(live: Swarm, capsys: pytest.CaptureFixture[str]) -> None:
    assert live.bootstrap is not None
    ids = _peer_ids(live)
    done = _dilocod("status", f"http://127.0.0.1:{live.bootstrap.http_port}")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("run dilocod · via bootstrap"), out
    for peer_id in ids:
        assert "…" + peer_id[-10:] in out, f"{peer_id} missing from:\n{out}"
    rows = [line for line in out.splitlines() if re.match(r"^…\S+\s+peer\s", line)]
    assert len(rows) == 3, out
    assert all(re.search(r"\s[0-9a-f]{12}\s", row) for row in rows), out  # θ hash column

    # Asked through a peer (in this process, through the same CLI entry point): its own view of the run,
    # itself marked; --wide prints whole ids.
    peer = live.peers[1]
    assert main(["status", f"127.0.0.1:{peer.http_port}", "--wide"]) == 0
    out = capsys.readouterr().out
    for peer_id in ids:
        assert peer_id in out, out
    assert f"{ids[1]}*" in out

    # --watch redraws until told to stop (here: after 2 redraws).
    url = f"http://127.0.0.1:{live.bootstrap.http_port}/"
    assert main(["status", url, "--watch", "--interval", "0.5", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("run dilocod · via bootstrap") == 2
    assert out.count("Ctrl-C stops") == 2


# ---- Prometheus ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _prometheus(tmp_path: Path, targets: dict[str, int]) -> Iterator[str]:
    """A real Prometheus server on loopback scraping `targets` (job → port) every second."""
    binary = need_program("prometheus")
    port = free_port()
    jobs = "".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        for job, target in targets.items()
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{jobs}")
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    api = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            return "Ready" in get_text(f"{api}/-/ready")

        wait_for("prometheus to be ready", ready, 60)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _query(api: str, expr: str) -> dict[str, Any]:
    answer = get_json(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    assert answer["status"] == "success", (expr, answer)
    return dict(answer["data"])


def _values(api: str, expr: str) -> list[float]:
    return [float(r["value"][1]) for r in _query(api, expr)["result"]]


def _grafana_exprs() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    return exprs


def test_prometheus_scrapes_peer_and_bootstrap(live: Swarm, tmp_path: Path) -> None:
    assert live.bootstrap is not None and live.bootstrap.http_port and live.peers[0].http_port
    peer = live.peers[0]
    targets = {"dilocod-peer": peer.http_port, "dilocod-bootstrap": live.bootstrap.http_port}
    with _prometheus(tmp_path, targets) as api:
        wait_for(
            "both targets to be up",
            lambda: sorted(_values(api, 'up{job=~"dilocod-.*"}')) == [1.0, 1.0],
            60,
        )
        peer_sel = '{job="dilocod-peer"}'
        wait_for(
            "the peer's outer step in Prometheus",
            lambda: (v := _values(api, f"dilocod_outer_step{peer_sel}")) and v[0] >= 2,
            60,
        )
        assert _values(api, f"dilocod_tokens_total{peer_sel}")[0] > 0
        assert _values(api, f"dilocod_inner_steps_total{peer_sel}")[0] >= 10
        assert 0 < _values(api, f"dilocod_train_loss{peer_sel}")[0] < 10
        assert 0 < _values(api, f"dilocod_eval_loss{peer_sel}")[0] < 10
        assert _values(api, f"dilocod_tokens_per_second{peer_sel}")[0] > 0
        assert sum(_values(api, 'dilocod_rounds_total{job="dilocod-peer", result=~"ok|alone"}')) >= 1
        assert _values(api, f"dilocod_outer_round_duration_seconds_count{peer_sel}")[0] >= 1
        assert _values(api, f"dilocod_group_size{peer_sel}")[0] >= 1
        assert 0 < _values(api, f"dilocod_compute_utilization{peer_sel}")[0] <= 1
        wait_for(
            "the bootstrap's view of the run: 3 peers",
            lambda: _values(api, 'dilocod_run_peers{job="dilocod-bootstrap"}') == [3.0],
            30,
        )
        assert _values(api, 'dilocod_run_tokens_per_second{job="dilocod-bootstrap"}')[0] > 0

        # Every dilocod_* series the peer exports came through.
        exported = {
            line.split("{")[0].split()[0]
            for line in get_text(f"http://127.0.0.1:{peer.http_port}/metrics").splitlines()
            if line.startswith("dilocod_")
        }
        stored = set(get_json(f"{api}/api/v1/label/__name__/values")["data"])
        assert exported - stored == set()

        # Every Grafana panel query is valid PromQL, and the core panels have data.
        time.sleep(3)  # a few more scrapes for the rate() windows
        empty = []
        for expr in _grafana_exprs():
            concrete = (
                expr.replace("$__rate_interval", "20s").replace("$job", ".*").replace("$instance", ".*")
            )
            if not _query(api, concrete)["result"]:
                empty.append(expr)
        core = [
            e
            for e in _grafana_exprs()
            if re.search(r"tokens_per_second|train_loss|eval_loss|run_peers|outer_step", e)
        ]
        assert core and not set(core) & set(empty), (
            f"core Grafana panels without data: {set(core) & set(empty)}"
        )


# ---- the dashboard in Chromium --------------------------------------------------------------------------
CHARTS = ("loss", "eval", "tps", "peers", "round", "group")
READY_JS = """([n, charts]) => {
  const points = (name) => Number(document.getElementById("chart-" + name).dataset.points || 0);
  return document.querySelectorAll("#peers tr[data-peer]").length === n
    && charts.every((name) => points(name) > 0)
    && document.querySelectorAll("#chart-loss path.series").length > 0;
}"""


def _sample(live: Swarm) -> dict[str, Any]:
    """The bootstrap's newest sample of θ_global (the peers write one every 2 rounds here)."""
    assert live.bootstrap is not None
    url = f"http://127.0.0.1:{live.bootstrap.http_port}/api/run"
    sample: dict[str, Any] = wait_for("a sample in /api/run", lambda: get_json(url)["sample"], 90)
    assert sample["prompt"] == "The" and isinstance(sample["text"], str) and sample["outer_step"] % 2 == 0
    assert sample["peer_id"] in _peer_ids(live) and 1 <= sample["peers_agreeing"] <= sample["peers_sampled"]
    return sample


def _open_dashboard(browser: Any, url: str, peers: int, screenshot: Path) -> dict[str, Any]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url, timeout=30_000)
        try:
            page.wait_for_function(READY_JS, arg=[peers, list(CHARTS)], timeout=90_000, polling=500)
        finally:
            page.screenshot(path=str(screenshot), full_page=True)
        found = page.evaluate(
            """(charts) => ({
              dots: Object.fromEntries(charts.map((c) => [c, document.querySelectorAll(`#chart-${c} circle.pt`).length])),
              lines: Object.fromEntries(charts.map((c) => [c, document.querySelectorAll(`#chart-${c} path.series`).length])),
              peers: [...document.querySelectorAll("#peers tr[data-peer]")].map((tr) => tr.dataset.peer),
              ownRounds: document.querySelectorAll("#rounds tr").length,
              ownRoundsShown: !document.getElementById("own-rounds-section").hidden,
              conn: document.getElementById("conn").textContent,
              servedBy: document.getElementById("served-by").textContent,
              peersCard: document.getElementById("card-peers").textContent,
              sharePoints: Number(document.getElementById("chart-share").dataset.points || 0),
              useful: document.getElementById("card-useful").textContent,
              samplePrompt: document.getElementById("sample-prompt").textContent,
              sampleText: document.getElementById("sample-text").textContent,
              sampleSub: document.getElementById("sample-sub").textContent,
              shareCells: [...document.querySelectorAll("#peers tr[data-peer] td:nth-child(10)")].map((td) => td.textContent),
            })""",
            list(CHARTS),
        )
        found["errors"] = errors
        return dict(found)
    finally:
        page.close()


def test_dashboard_renders_the_live_run(live: Swarm) -> None:
    chromium = need_program("chromium")
    sync_playwright = playwright()
    assert live.bootstrap is not None
    ids = sorted(_peer_ids(live))
    sample = _sample(live)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            shot = artifact("dashboard-bootstrap.png")
            found = _open_dashboard(browser, f"http://127.0.0.1:{live.bootstrap.http_port}/", 3, shot)
            assert found["errors"] == []
            assert sorted(found["peers"]) == ids
            assert found["peersCard"] == "3"
            assert found["conn"].startswith("live")
            assert "bootstrap" in found["servedBy"]
            for chart in CHARTS:
                assert found["dots"][chart] > 0, (chart, found)
            assert found["lines"]["loss"] >= 3  # one line per peer (plus the run mean)
            # Each peer's contribution share: a line each, a run-wide card, a table column.
            assert found["sharePoints"] > 0 and found["useful"].endswith("%"), found
            assert all(cell.endswith("%") for cell in found["shareCells"]), found["shareCells"]
            assert not found["ownRoundsShown"]  # a bootstrap has no rounds of its own
            # What θ_global writes: the run's prompt, a completion, the round it came from.
            assert found["samplePrompt"] == "The" and found["sampleText"], found
            assert re.search(r"outer step \d+, by peer …", found["sampleSub"]), found["sampleSub"]
            assert int(re.findall(r"outer step (\d+)", found["sampleSub"])[0]) >= sample["outer_step"]
            assert shot.stat().st_size > 10_000

            # The same page served by a peer: its view of the run, plus its own rounds.
            peer = live.peers[0]
            shot = artifact("dashboard-peer.png")
            found = _open_dashboard(browser, f"http://127.0.0.1:{peer.http_port}/", 3, shot)
            assert found["errors"] == []
            assert sorted(found["peers"]) == ids
            assert "peer" in found["servedBy"]
            assert found["ownRoundsShown"] and found["ownRounds"] >= 2
            for chart in CHARTS:
                assert found["dots"][chart] > 0, (chart, found)
        finally:
            browser.close()
