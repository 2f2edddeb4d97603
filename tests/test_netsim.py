"""bench/netsim: the simulation is deterministic, keeps the protocol's promises in a small run, and runs the
daemon's own round machine and clock (a changed rule changes its output)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netsim.run import Simulation, simulate
from bench.netsim.settings import Scenario, run_params
from dilocod.rounds import clock, machine

ROOT = Path(__file__).resolve().parents[1]
KEYS = (
    "peers", "rounds", "tokens_in_global_share", "full_group_share", "one_global_share", "round_seconds",
    "utilization", "bytes_per_peer_round", "dht_messages_per_peer_round", "joiner_seconds",
    "bootstrap_requests_per_second", "bootstrap_bytes_per_second",
)  # fmt: skip


def test_one_seed_gives_one_result() -> None:
    scenario = Scenario(peers=10, rounds=3, nat=0.5, churn=60.0, seed=3)
    assert simulate(scenario) == simulate(scenario)
    assert simulate(scenario) != simulate(Scenario(peers=10, rounds=3, nat=0.5, churn=60.0, seed=5))


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


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "netsim.py"), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_the_command_prints_the_issues_keys() -> None:
    done = _cli("--peers", "5", "--rounds", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(KEYS) <= set(result) and result["peers"] == 5 and result["rounds"] == 2


@pytest.mark.parametrize(("args", "says"), [
    (["--peers", "10", "--nat", "1.5"], "--nat must be a share in [0, 1)"),
    (["--peers", "10", "--speeds", "fast"], "invalid choice: 'fast'"),
    (["--peers", "1"], "--peers must be at least 2"),
])  # fmt: skip
def test_a_bad_flag_gets_one_line(args: list[str], says: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2
    assert says in done.stderr.strip().splitlines()[-1]
