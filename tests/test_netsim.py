"""bench/netsim: the simulation is deterministic, keeps the protocol's promises in a small run, and runs the
daemon's own round machine and clock (a changed rule changes its output)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

import pytest

from bench.netsim.coordinator import IndexedBook
from bench.netsim.run import Simulation, simulate
from bench.netsim.settings import Scenario, run_params
from dilocod.data.schedule import ChunkBook
from dilocod.rounds import clock, machine

ROOT = Path(__file__).resolve().parents[1]
KEYS = (
    "peers", "rounds", "tokens_in_global_share", "full_group_share", "one_global_share", "round_seconds",
    "utilization", "bytes_per_peer_round", "dht_messages_per_peer_round", "joiner_seconds",
    "bootstrap_requests_per_second", "bootstrap_bytes_per_second",
)  # fmt: skip


def test_one_seed_gives_one_result() -> None:
    scenario = Scenario(peers=10, rounds=3, nat=0.5, churn=6000.0, seed=3)
    assert simulate(scenario) == simulate(scenario)
    assert simulate(scenario) != simulate(Scenario(peers=10, rounds=3, nat=0.5, churn=6000.0, seed=5))


@pytest.mark.parametrize("seed", range(5))
def test_a_round_whose_groups_failed_is_tried_again_under_heavy_churn(seed: int) -> None:
    """6,000 %/hour: each peer leaves once a minute on average. A leaver takes its group's all-reduce down; the survivors train the same round again and meet in a
    new matchmaking (seed 4 once stalled here: its retry found the round's first book and no group)."""
    result = simulate(Scenario(peers=10, rounds=3, nat=0.5, churn=6000.0, seed=seed))
    assert result["rounds"] == 3 and not result["stalled"]


def test_a_run_that_cannot_close_a_round_stops_and_says_it_stalled() -> None:
    scenario = Scenario(peers=4, rounds=2)
    params = run_params(scenario)
    avg = dataclasses.replace(params.cfg.averaging, min_group_size=5)  # more trainers than there are
    rnd = dataclasses.replace(params.cfg.round, max_seconds=60.0)
    cfg = dataclasses.replace(params.cfg, averaging=avg, round=rnd)
    result = Simulation(scenario, dataclasses.replace(params, cfg=cfg)).run()
    assert result["stalled"] and result["rounds"] == 0
    assert result["simulated_seconds"] <= 6 * 60.0 + 60.0


def test_equal_peers_without_churn_put_every_token_into_the_global_weights() -> None:
    result = simulate(Scenario(peers=10, rounds=4))
    assert result["rounds"] == 4
    assert result["tokens_in_global_share"] == 1.0
    assert result["full_group_share"] == 1.0 and result["one_global_share"] == 1.0
    assert result["outcomes"] == {"ok": 40}


def test_a_killed_peers_chunks_go_back_to_the_run() -> None:
    scenario = Scenario(peers=10, rounds=25, seed=1)
    params = run_params(scenario)
    short = dataclasses.replace(params.cfg, data=dataclasses.replace(params.cfg.data, lease_seconds=20.0))
    sim = Simulation(scenario, dataclasses.replace(params, cfg=short))  # leases expire within the run
    victim = sim.peers
    held: list[tuple[int, int, int]] = []
    sim.queue.at(20.0, lambda: held.extend(_kill(sim, "p00004")))
    sim.run()
    assert not victim["p00004"].alive and held
    book = sim.coordinator.book
    for epoch, chunk, _ in held:  # handed out again (or trained to its end) by someone else
        lease = book.epochs[epoch].leases.get(chunk) if epoch in book.epochs else None
        assert lease is None or lease.peer != "p00004"
        back = epoch in book.epochs and chunk in {c for c, _ in book.epochs[epoch].returned}
        assert back or lease is not None or epoch not in book.epochs, "the chunk did not go back to the run"


def _kill(sim: Simulation, peer_id: str) -> list[tuple[int, int, int]]:
    """Kill a peer; the leases it held."""
    peer = sim.peers[peer_id]
    sim._account_alive(peer)
    peer.alive = False
    sim.live -= 1
    for book in list(sim.rounds.values()):
        sim._maybe_match(book)
    return list(peer.leases)


def test_the_simulation_runs_the_daemons_round_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = machine.transition

    def counted(state, event, settings):  # type: ignore[no-untyped-def]
        calls.append(type(event).__name__)
        return real(state, event, settings)

    monkeypatch.setattr(machine, "transition", counted)
    simulate(Scenario(peers=4, rounds=2))
    assert {"Closed", "Averaged"} <= set(calls)


def test_a_changed_clock_rule_changes_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    before = simulate(Scenario(peers=6, rounds=2))
    real = clock.should_stop
    # a trainer that stops only a whole step after the close, instead of at the nearer step boundary
    monkeypatch.setattr(
        clock, "should_stop", lambda close_at, now, step: real(close_at + (step or 0), now, step)
    )
    after = simulate(Scenario(peers=6, rounds=2))
    assert after["round_seconds"] > before["round_seconds"]


def _command() -> ModuleType:
    """bench/netsim.py, loaded as the command runs it (in this process: a subprocess would import the
    daemon's dependencies again, seconds each)."""
    spec = importlib.util.spec_from_file_location("netsim_command", ROOT / "bench" / "netsim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_prints_the_issues_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert _command().main(["--peers", "5", "--rounds", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(KEYS) <= set(result) and result["peers"] == 5 and result["rounds"] == 2


@pytest.mark.parametrize(("args", "says"), [
    (["--peers", "10", "--nat", "1.5"], "--nat must be a share in [0, 1)"),
    (["--peers", "10", "--speeds", "fast"], "invalid choice: 'fast'"),
    (["--peers", "1"], "--peers must be at least 2"),
])  # fmt: skip
def test_a_bad_flag_gets_one_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        _command().main(args)
    assert done.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_indexed_chunk_book_answers_as_the_daemons_book() -> None:
    """bench/netsim's faster book: the same grants and expiries as `ChunkBook` for the same calls."""
    rng = random.Random(7)
    books = [cls(5_000, 100, "netsim", 30.0) for cls in (ChunkBook, IndexedBook)]
    held: dict[str, list[tuple[int, int, int]]] = {}
    now = 0.0
    for _ in range(3_000):
        now += rng.expovariate(1.0)
        peer = f"p{rng.randrange(12)}"
        if rng.random() < 0.1:
            answers = [book.expire(now) for book in books]
        else:
            report = [(e, c, o + rng.randrange(60)) for e, c, o in held.get(peer, []) if rng.random() < 0.9]
            want = rng.randrange(3)
            answers = [book.sync(peer, report, want, now) for book in books]
            held[peer] = [(g.epoch, g.chunk, g.offset) for g in answers[0]]
        assert answers[0] == answers[1]
    assert books[0].to_json() == books[1].to_json()
