"""A peer's state has owners: each part of `PeerState` is written by one module, and the phase is derived.

The scan reads every module of the daemon for assignments to a part's fields (`x.rounds.outer_step = …`,
`self.inner.loss = …`, through the names the owners give their part) and says who writes what.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dilocod.observability import peerstate
from dilocod.observability.peerstate import PeerState, Phase, phase_of

ROOT = Path(__file__).resolve().parents[1] / "dilocod"

# part attribute of PeerState -> (its class, the names its writer holds it by, the one module that writes it)
OWNERS: dict[str, tuple[type, set[str], str]] = {
    "facts": (peerstate.NodeFacts, {"facts"}, "node/peer.py"),
    "inner": (peerstate.InnerProgress, {"inner"}, "node/training.py"),
    "rounds": (peerstate.RoundProgress, {"rounds"}, "rounds/effects.py"),
    "dataset": (peerstate.DataProgress, {"dataset", "progress"}, "node/dataset.py"),
    "shards": (peerstate.ShardProgress, {"shards", "shown"}, "node/shardfetch.py"),
    "trust": (peerstate.TrustCounts, {"trust"}, "node/judge.py"),
    "swarm": (peerstate.SwarmView, {"swarm"}, "node/publishing.py"),
}
COMPOSER = "node/peer.py"  # puts the parts together (assigns `state.inner`, `state.rounds`, `state.tokens`)


def last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def stored(tree: ast.AST) -> list[ast.Attribute]:
    """Every attribute assigned in the module (plain, augmented, annotated, in tuples)."""
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets.append(node.target)
    flat: list[ast.Attribute] = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets += target.elts
        elif isinstance(target, ast.Attribute):
            flat.append(target)
    return flat


def setattr_targets(tree: ast.AST) -> list[str | None]:
    return [
        last_name(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and node.args
    ]


def writers(root: Path = ROOT) -> tuple[dict[str, set[str]], set[str], list[str]]:
    """(part -> modules that write its fields, modules that assign parts of a PeerState, setattr on parts)."""
    fields = {part: {f.name for f in dataclasses.fields(cls)} for part, (cls, _, _) in OWNERS.items()}
    parts_of_state = {f.name for f in dataclasses.fields(PeerState)}
    found: dict[str, set[str]] = {part: set() for part in OWNERS}
    composers: set[str] = set()
    dynamic: list[str] = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in stored(tree):
            holder = last_name(target.value)
            for part, (_, names, _) in OWNERS.items():
                if holder in names and target.attr in fields[part]:
                    found[part].add(module)
            if holder == "state" and target.attr in parts_of_state:
                composers.add(module)
        for holder in setattr_targets(tree):
            if any(holder in names for _, names, _ in OWNERS.values()):
                dynamic.append(f"{module}: setattr on {holder}")
    return found, composers, dynamic


def test_each_part_of_a_peers_state_has_one_writer() -> None:
    found, composers, dynamic = writers()
    for part, (_, _, owner) in OWNERS.items():
        assert found[part] == {owner}, (
            f"PeerState.{part} is written by {sorted(found[part])}, only {owner} may"
        )
    assert composers == {COMPOSER}, f"only {COMPOSER} puts a peer's state together, not {sorted(composers)}"
    assert dynamic == []


def test_the_scan_sees_a_second_writer(tmp_path: Path) -> None:
    """The check can fail: a copy of the tree where the driver sets the phase itself is caught."""
    copy = tmp_path / "dilocod"
    for path in ROOT.rglob("*.py"):
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    driver = copy / "rounds" / "driver.py"
    driver.write_text(driver.read_text() + "\n\ndef meddle(state):\n    state.rounds.activity = None\n")
    found, _, _ = writers(copy)
    assert found["rounds"] == {"rounds/effects.py", "rounds/driver.py"}


@pytest.mark.parametrize(
    ("life", "activity", "shown"),
    [
        (Phase.STARTING, None, Phase.STARTING),
        (Phase.FETCHING_DATA, None, Phase.FETCHING_DATA),
        (Phase.TRAINING, None, Phase.TRAINING),  # started, before the driver's first command
        (Phase.TRAINING, Phase.AVERAGING, Phase.AVERAGING),
        (Phase.TRAINING, Phase.SYNCING, Phase.SYNCING),
        (Phase.TRAINING, Phase.TRAINING, Phase.TRAINING),
        (Phase.STOPPING, Phase.AVERAGING, Phase.STOPPING),  # a stop shows over the round's activity
    ],
)
def test_the_phase_comes_from_the_life_cycle_then_the_round_driver(
    life: Phase, activity: Phase | None, shown: Phase
) -> None:
    assert phase_of(life, activity) is shown
    state = PeerState()
    state.facts.life, state.rounds.activity = life, activity
    assert state.status()["phase"] == shown.value and isinstance(state.status()["phase"], str)
