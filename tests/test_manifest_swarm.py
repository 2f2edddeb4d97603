"""The run's manifest through the CLI: `dilocod join <maddr>` with nothing else trains in a run of
non-default settings; a contradicting peer or bootstrap is refused naming the key; a bootstrap with
`--run-dir` keeps its identity and manifest; a peer left with another manifest says so, naming the keys."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID

from dilocod.config import load_config
from dilocod.manifest.obtain import store
from dilocod.manifest.record import issue
from dilocod.node.demo import free_port
from peers.auth import Identity
from tests.harness import FAST, REPO, Swarm, get_json, round_hashes, wait_for

pytestmark = pytest.mark.integration

# Non-default run-wide settings (with FAST's H = 5): a newcomer with the defaults could not average.
RUN = ("averaging.compression=int2", "averaging.reducer=trimmed_mean")


def dilocod(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def manifest_of(s: Swarm) -> dict[str, object]:
    assert s.bootstrap is not None
    return dict(get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/run/manifest"))


def test_a_bare_join_trains_in_the_run_and_the_bootstrap_keeps_its_home(
    swarm: Callable[..., Swarm], tmp_path: Path
) -> None:
    home = tmp_path / "bootstrap-home"
    s = swarm(0, *RUN, bootstrap=False)
    s.start_bootstrap("dilocod", "--run-dir", str(home))
    manifest = manifest_of(s)
    assert manifest["settings"]["averaging"]["compression"] == "int2"  # type: ignore[index]
    configured = s.add_peer()
    bare = s.add_peer(bare=True)  # `dilocod join <maddr>`: no config, no --set

    # A newcomer whose own settings contradict the run's is told which, and stops.
    refused = dilocod(
        "join", s.maddr, "--run-dir", str(tmp_path / "odd"), "--set", "averaging.compression=none"
    )
    assert refused.returncode == 2, refused.stderr
    assert (
        "dilocod: error: averaging.compression: the run uses int2, you set none"
        in refused.stderr.splitlines()
    )

    statuses = s.wait_all_at(3, timeout=240)
    assert {st["manifest_hash"] for st in statuses} == {manifest["manifest_hash"]}
    head = (
        f"joined run 'dilocod' (manifest {str(manifest['manifest_hash'])[:12]}: tiny, H=5, int2, trimmed_mean"
    )
    assert head in bare.output()
    for step, found in round_hashes(statuses).items():
        assert len(found) == 1, f"peers disagree on θ_global after outer step {step}: {found}"

    def shared() -> list[int]:
        theirs = {o["outer_step"] for o in configured.status()["rounds"] if o["result"] == "ok"}
        return [
            e["outer_step"]
            for e in bare.status()["rounds"]
            if e["result"] == "ok" and e["outer_step"] in theirs
        ]

    # The configured peer may start a few rounds alone before the bare one is up (a loaded machine): the bare
    # peer re-syncs to it, then they average together.
    try:
        wait_for("a round the bare peer averaged with the configured one", shared, 120)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    assert s.bootstrap is not None
    run = get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/run")["peers"]
    assert run and not any(p["other_manifest"] for p in run)

    # A second bootstrap given the first's address serves the run's manifest, not one of its defaults.
    second_port = free_port()
    second = s._proc(
        "bootstrap-2",
        ["bootstrap", s.maddr, "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1",
         "--http-port", str(second_port), "--no-reduce"],
        tmp_path / "bootstrap-2.log", second_port, None, None,
    )  # fmt: skip
    s.peers.append(second)  # reaped with the swarm
    second.start()
    served = wait_for(
        "the second bootstrap's manifest",
        lambda: get_json(f"http://127.0.0.1:{second_port}/api/run/manifest"),
        60,
    )
    assert served["manifest_hash"] == manifest["manifest_hash"] and served["signer"] == manifest["signer"]
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0
    s.peers.remove(second)

    # The bootstrap's home: restarted with it, the same peer id and manifest; a contradiction is refused.
    before = get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/status")
    s.bootstrap.signal(signal.SIGTERM)
    assert s.bootstrap.wait(timeout=60) == 0
    assert {"identity.key", "manifest.bin", "bootstrap.log"} <= {p.name for p in home.iterdir()}
    contradicting = dilocod(
        "bootstrap", "--run-dir", str(home), "--port", "0", "--set", "trainer.inner_steps=9"
    )
    assert contradicting.returncode == 2
    assert (
        "dilocod: error: trainer.inner_steps: the run uses 5, you set 9" in contradicting.stderr.splitlines()
    )
    (tmp_path / "bootstrap.maddr").unlink(missing_ok=True)
    s.bootstrap.start()
    after = wait_for(
        "the restarted bootstrap",
        lambda: get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/status"),
        60,
    )
    assert after["peer_id"] == before["peer_id"]
    assert manifest_of(s)["manifest_hash"] == manifest["manifest_hash"]


def test_a_peer_left_with_another_manifest_never_averages_and_names_the_keys(
    swarm: Callable[..., Swarm], tmp_path: Path
) -> None:
    s = swarm(2, *RUN)
    # The odd peer ran in this run before under other settings, from another bootstrap: it refuses the
    # bootstrap's manifest (another signer, other content) and keeps its own.
    odd_dir = tmp_path / "odd"
    odd_dir.mkdir()
    P2P.generate_identity(str(tmp_path / "other-bootstrap.key"))
    theirs = load_config(REPO / "configs" / "tiny.toml", [*FAST, "averaging.compression=int8"])
    store(odd_dir, issue(theirs, Identity.load(tmp_path / "other-bootstrap.key")))
    odd = s.add_peer(bare=True, start=False)
    odd.run_dir = odd_dir
    odd.args[odd.args.index("--run-dir") + 1] = str(odd_dir)
    odd.log = odd_dir / "console.log"
    odd.start()

    reason = wait_for(
        "the odd peer to say why it does not contribute",
        lambda: (st := odd.status()).get("not_contributing_reason") and st,
        240,
    )
    assert reason["contributing"] is False
    text = reason["not_contributing_reason"]
    assert "other settings than the run" in text and "averaging.compression" in text, text
    assert "refused the manifest of" in odd.output()
    warned = [
        line
        for line in odd.output().splitlines()
        if " WARN " in line and "other settings than the run" in line
    ]
    assert len(warned) == 1, warned
    assert not any(e["result"] == "ok" for e in odd.status()["rounds"])
    assert s.bootstrap is not None
    run = get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/run")["peers"]
    flagged = {p["peer_id"]: p["other_manifest"] for p in run}
    assert flagged.get(reason["peer_id"]) is True
    assert not any(flagged[st["peer_id"]] for st in (p.status() for p in s.peers[:2]))
    assert re.search(r"every other peer runs manifest [0-9a-f]{12}", text)


@pytest.fixture(scope="module", autouse=True)
def unanswered_join(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    """`dilocod join` at an address nobody answers at, started with the module: its 30 s of retries pass
    while the other tests here run (it waits on the network; it takes no CPU worth speaking of)."""
    root = tmp_path_factory.mktemp("nobody")
    P2P.generate_identity(str(root / "nobody.key"))
    nobody = PeerID(Identity.load(root / "nobody.key").peer_id).to_base58()
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{nobody}"
    with (root / "join.err").open("w") as err:  # a file, not a pipe nobody reads for 30 s
        join = subprocess.Popen(
            [sys.executable, "-m", "dilocod", "join", maddr, "--run-dir", str(root / "run")],
            stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=REPO,
        )  # fmt: skip
    try:
        yield maddr, root / "run", join
    finally:
        if join.poll() is None:
            join.kill()
        join.wait()


def test_no_manifest_from_the_peers_given_is_one_line_and_exit_2(
    unanswered_join: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    """Nobody answers at the address given: after 30 s of retries, one line naming it, exit 2."""
    maddr, run_dir, join = unanswered_join
    join.wait(timeout=120)
    stderr = (run_dir.parent / "join.err").read_text()
    assert join.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("dilocod: error:")]
    assert len(errors) == 1 and "no run manifest we can take from the peers given" in errors[0], stderr
    assert f"{maddr}: cannot connect" in errors[0]
    assert not (run_dir / "checkpoint.pt").exists()
