"""Re-syncing: which θ hash a donor's state must have (the ledger), and adopting a state with or without
keeping our progress not yet averaged."""

from __future__ import annotations

from typing import Any

import pytest

from dilocod.statesync.ledger import (
    LIE,
    SPLIT,
    declared_lie,
    expected_hash,
    minority_holders,
    remember_hashes,
    served_verdict,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64


def ports(**given: Any) -> Any:
    """`SyncPorts` with what a test passes, None for the rest (the test never reaches those)."""
    from dilocod.statesync.catchup import SyncPorts

    names = ("in_trainer", "records", "punish", "banned", "on_adopted", "count_bytes")
    return SyncPorts(**{name: given.get(name) for name in names})


def sync_settings(cfg: Any) -> Any:
    from dilocod.statesync.catchup import SyncSettings

    return SyncSettings(cfg.net.status_interval, cfg.averaging.state_timeout, cfg.outer)


def record(peer: str, step: int, sha: str = A, **extra: Any) -> dict[str, Any]:
    return {"peer_id": peer, "outer_step": step, "global_sha256": sha, **extra}


def test_the_ledger_remembers_steps_the_run_has_left() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("p1", 9), record("p2", 9), record("liar", 9, B)])
    remember_hashes(seen, [record("p1", 10, C), record("p2", 10, C), record("liar", 10, C)])
    # A donor that sends step 9's state after everyone moved on is still checked against step 9.
    assert expected_hash(seen, 9, "liar") == A
    assert expected_hash(seen, 10, "p1") == C


def test_the_donor_alone_only_counts_when_nobody_else_reported_the_step() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("donor", 4, B), record("p1", 3)])
    assert expected_hash(seen, 4, "donor") == B
    assert expected_hash(seen, 5, "donor") is None
    remember_hashes(seen, [record("p1", 4, A), record("p2", 4, A)])
    assert expected_hash(seen, 4, "donor") == A


def test_a_tie_holds_nobody_to_either_hash() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("p1", 4, A), record("p2", 4, B), record("donor", 4, B)])
    assert expected_hash(seen, 4, "donor") == B  # the donor's report breaks the tie it is part of
    remember_hashes(seen, [record("p3", 5, A), record("p4", 5, B), record("donor", 5, C)])
    assert expected_hash(seen, 5, "donor") is None  # no majority to call the donor a liar by
    remember_hashes(seen, [record("p5", 5, A)])
    assert expected_hash(seen, 5, "donor") == A


def test_one_against_one_each_donor_is_held_to_its_own_report() -> None:
    # A run split in two at step 1 (one peer of each half reported): a peer still at step 0 must be able to
    # re-sync from either half. Held to the other's hash, both were refused and it never left step 0.
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("a", 1, A), record("b", 1, B)])
    assert expected_hash(seen, 1, "a") == A and expected_hash(seen, 1, "b") == B
    assert served_verdict(seen, 1, "a", A, A) is None
    remember_hashes(seen, [record("c", 1, A)])  # then a majority exists, and the other half is a split
    assert expected_hash(seen, 1, "b") == A
    assert served_verdict(seen, 1, "b", B, A) == (SPLIT, False)


def test_a_donor_that_holds_a_minority_theta_it_reports_is_skipped_not_called_a_liar() -> None:
    seen: dict[int, dict[str, str]] = {}
    # Two groups averaged apart at step 4: three peers hold A, the split-off donor B (and says so).
    remember_hashes(seen, [record("p1", 4, A), record("p2", 4, A), record("p3", 4, A), record("split", 4, B)])
    remember_hashes(seen, [record("liar", 4, A)])
    table = [
        ("p1", A, None),  # the run's θ: adopted
        ("split", B, (SPLIT, False)),  # serves what it reports: refused, not punished
        ("liar", C, (LIE, True)),  # reports A, serves C
        ("silent", C, (LIE, True)),  # serves a θ it never reported
    ]
    for donor, served, verdict in table:
        assert served_verdict(seen, 4, donor, served, A) == verdict, donor
    # A head outvoted by the other donors' is held to the same records before anything is downloaded.
    assert [declared_lie(seen, 4, d, served) for d, served, _ in table] == [None, None, LIE, LIE]
    assert declared_lie(seen, 5, "ahead", C) is None  # a round ahead of every record: nothing to hold it to
    assert minority_holders(seen) == ["split"]  # not worth a download
    remember_hashes(seen, [record("split", 4, A)])  # it re-synced to the run's θ
    assert minority_holders(seen) == []
    remember_hashes(seen, [record("p1", 5, C), record("p2", 5, B)])
    assert minority_holders(seen) == []  # one against one at step 5: nobody is held to either
    remember_hashes(seen, [record("p3", 5, C)])
    assert minority_holders(seen) == ["p2"]


def test_a_peer_that_re_synced_at_a_step_counts_once_with_its_latest_hash() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("p1", 4, B), record("p2", 4, A), record("p3", 4, A)])
    remember_hashes(seen, [record("p1", 4, A)])
    assert seen[4] == {"p1": A, "p2": A, "p3": A}


def test_the_ledger_is_bounded() -> None:
    seen: dict[int, dict[str, str]] = {}
    for step in range(100):
        remember_hashes(seen, [record("p1", step)], keep=8)
    assert sorted(seen) == list(range(92, 100))


def adopter(rebase_on_resync: bool) -> Any:
    """A `StateSync` with a real tiny trainer and outer optimizer, a few inner steps past θ_global."""
    from dilocod.config import load_config
    from dilocod.diloco import OuterOptimizer
    from dilocod.statesync.catchup import StateSync
    from dilocod.trainer import InnerTrainer

    cfg = load_config(
        None,
        [
            "trainer.batch_size=2",
            "trainer.seq_len=16",
            "trainer.threads=1",
            f"outer.rebase_on_resync={str(rebase_on_resync).lower()}",
        ],
    )
    keeper: Any = object.__new__(StateSync)
    keeper.settings, keeper.ports = sync_settings(cfg), ports(on_adopted=lambda: None)
    keeper.trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="catchup")
    keeper.outer = OuterOptimizer(keeper.trainer.working_params_fp32(), cfg.outer)
    keeper.trainer.train_steps(2)
    return keeper


def donor_state(keeper: Any) -> list[Any]:
    return [p + 0.01 for p in keeper.outer.params] + [m.clone() for m in keeper.outer.momentum]


def test_adopting_with_rebase_keeps_the_progress_not_yet_averaged() -> None:
    import torch

    keeper = adopter(rebase_on_resync=True)
    old_global = [p.clone() for p in keeper.outer.params]
    local = keeper.trainer.working_params_fp32()
    kept = keeper.adopt_in_trainer(2, donor_state(keeper))
    progress = [g - t for g, t in zip(old_global, local)]
    assert kept is not None and abs(kept - float(torch.sqrt(sum(d.square().sum() for d in progress)))) < 1e-4
    for now, new, d in zip(keeper.trainer.working_params_fp32(), keeper.outer.params, progress):
        assert torch.allclose(now, new - d, atol=1e-6)
    assert keeper.outer.step == 2


def test_adopting_without_rebase_restarts_from_the_new_global() -> None:
    import torch

    keeper = adopter(rebase_on_resync=False)
    assert keeper.adopt_in_trainer(1, donor_state(keeper)) is None
    for now, new in zip(keeper.trainer.working_params_fp32(), keeper.outer.params):
        assert torch.equal(now, new)


def server(*overrides: str) -> Any:
    """A `StateSync` serving a tiny θ_global (no trainer, no network)."""
    import torch

    from dilocod.config import load_config
    from dilocod.diloco import OuterOptimizer
    from dilocod.statesync.catchup import StateSync
    from dilocod.trust.adversary import Adversary

    cfg = load_config(None, list(overrides))

    class Group:
        def set_state_step(self, step: float) -> None:
            self.step = step

    outer = OuterOptimizer([torch.ones(4), torch.zeros(2, 3)], cfg.outer)
    return StateSync(
        sync_settings(cfg), outer, None, Group(), Adversary(cfg.adversary, 0),  # type: ignore[arg-type]
        ports(banned=list, on_adopted=lambda: None),
    )  # fmt: skip


def test_a_donor_with_overlap_serves_its_completed_round_in_flight_until_the_close() -> None:
    import torch

    from proto import decode_state_meta

    sync = server()
    sync.share()
    meta, tensors = sync.current()
    assert decode_state_meta(meta)["pending_tensors"] == 0 and len(tensors) == 4
    averaged = [torch.full((4,), 0.5), torch.full((2, 3), -1.0)]
    sync.share_pending(sync.outer.step + 1, averaged)  # not our step: a round we are not at
    assert len(sync.current()[1]) == 4
    sync.share_pending(sync.outer.step, averaged)
    meta, tensors = sync.current()
    decoded = decode_state_meta(meta)
    assert decoded["pending_tensors"] == 2 and decoded["num_tensors"] == 6 and len(tensors) == 6
    assert all(torch.equal(a, b) for a, b in zip(tensors[4:], averaged))
    assert sync._check_content(tensors, decoded) is None  # a joiner accepts it
    # too few or non-finite pending tensors are the donor's lie
    assert sync._check_content(tensors[:5], decoded) is not None
    poisoned = [*tensors[:4], torch.full((4,), float("nan")), tensors[5]]
    assert "round in flight" in sync._check_content(poisoned, decoded)
    # a v1 donor's metadata names no pending tensors: its state alone is accepted
    assert sync._check_content(tensors[:4], {**decoded, "pending_tensors": None}) is None
    sync.share()  # the close applied it: a new θ_global, nothing pending
    assert decode_state_meta(sync.current()[0])["pending_tensors"] == 0


def test_an_adaptive_outer_step_serves_and_takes_its_second_moments() -> None:
    """FedAdam/FedYogi: θ_global, m and v (and a round in flight after them); a donor of θ and m alone (another
    outer step) is refused."""
    import torch

    from proto import decode_state_meta

    sync = server("outer.optimizer=fedadam")
    sync.outer.apply([torch.full((4,), 0.1), torch.full((2, 3), -0.2)])
    sync.share()
    meta, tensors = sync.current()
    decoded = decode_state_meta(meta)
    assert decoded["num_tensors"] == 6 and len(tensors) == 6
    assert all(torch.equal(a, b) for a, b in zip(tensors[4:], sync.outer.second))
    assert sync._check_content(tensors, decoded) is None
    assert "expected 6 tensors" in sync._check_content(tensors[:4], {**decoded, "num_tensors": 4})
    sync.share_pending(sync.outer.step, [torch.full((4,), 0.5), torch.full((2, 3), -1.0)])
    meta, tensors = sync.current()
    decoded = decode_state_meta(meta)
    assert (
        decoded["pending_tensors"] == 2
        and len(tensors) == 8
        and sync._check_content(tensors, decoded) is None
    )


def test_the_outer_step_frees_the_old_state_once_the_snapshot_is_withdrawn() -> None:
    """The snapshot holds θ_global and the momentum themselves (no copy); withdrawn for the outer step, the
    old tensors are freed as the step replaces them instead of living through it (8 bytes a parameter)."""
    import gc
    import weakref

    import torch

    sync = server()
    averaged = [torch.full_like(p, 0.1) for p in sync.outer.params]

    def survivors(withdraw: bool) -> int:
        sync.share()
        old = [weakref.ref(t) for t in sync.outer.state_tensors()]
        if withdraw:
            sync.withdraw()
            with pytest.raises(RuntimeError, match="no state"):
                sync.current()  # a downloader meanwhile asks another donor
        sync.outer.apply(averaged)
        gc.collect()
        alive = sum(ref() is not None for ref in old)
        sync.share()
        assert sync.current()[1][0] is sync.outer.params[0]  # offered again: the new state
        return alive

    assert survivors(withdraw=False) == 4  # all of θ_global and the momentum, until the next share
    assert survivors(withdraw=True) == 0


def test_a_re_sync_downloads_in_parts_from_every_donor_and_punishes_a_liar_at_once() -> None:
    """StateSync's download goes through the part plan: donors from the run's records, a lying donor
    punished as soon as its part misses the digest, and the state then checked against the run's hash."""
    import asyncio

    import torch

    from dilocod.config import load_config
    from dilocod.diloco import OuterOptimizer
    from dilocod.statesync.catchup import StateSync
    from dilocod.statesync.parts import PartsSource
    from dilocod.trust.adversary import Adversary
    from peers.state.download import PartsDownload
    from tests.test_statedownload import FakeDonors

    cfg = load_config(None)

    class Group:
        def set_state_step(self, step: float) -> None:
            self.step = step

        def state_timeout(self, configured: float) -> float:
            return 30.0

    def sync(parts: Any = None, **kwargs: Any) -> StateSync:
        outer = OuterOptimizer([torch.linspace(0, 1, 300_000), torch.ones(7)], cfg.outer)
        return StateSync(
            sync_settings(cfg), outer, None, Group(), Adversary(cfg.adversary, 0),  # type: ignore[arg-type]
            ports(on_adopted=lambda: None, **kwargs), parts,
        )  # fmt: skip

    donor = sync(banned=list)
    donor.share()
    served = donor.current()
    records = [record(peer, 0, donor.outer.sha256) for peer in ("a", "b", "liar")]
    punished: list[tuple[str, str]] = []
    status: dict[str, Any] = {}

    async def read_records() -> list[dict[str, Any]]:
        return records

    async def punish(found: list[tuple[str, str]]) -> None:
        punished.extend(found)

    fake = FakeDonors({peer: served for peer in ("a", "b", "liar")}, {"liar": "liar"})
    parts = PartsSource(PartsDownload(fake, max_bytes=10 << 20), status.update)
    joiner = sync(records=read_records, punish=punish, banned=list, parts=parts)

    async def main() -> tuple[Any, list[str], Any]:
        tried: list[str] = []
        downloaded, donors, again = await joiner._download(tried, 0)
        assert not again and "liar" in tried
        return downloaded, donors, await joiner._verify(downloaded, 0)

    downloaded, donors, verdict = asyncio.run(main())
    assert verdict is None  # its θ_global is the one the run reports: it would be adopted
    assert all(torch.equal(a, b) for a, b in zip(downloaded.tensors, served[1]))
    assert [p for p, _ in punished] == ["liar"] and sorted(donors) == ["a", "b", "liar"]
    assert set(status["parts_from"]) == {"a", "b"} and status["banned"] == ["liar"] and not status["active"]


def test_an_outvoted_head_ahead_of_the_records_is_judged_when_they_arrive() -> None:
    # A bad donor declares the run's newest step with its own θ while the records still stop a step
    # earlier (its honest peers just closed the round): the download goes on without it, and it is refused
    # and punished once their records for that step arrive (a fast run missed it for good before).
    import asyncio
    import time

    from dilocod.config import load_config
    from dilocod.statesync.catchup import StateSync
    from proto import encode_state_meta

    def head(step: int, sha: str) -> bytes:
        meta = {"outer_step": step, "global_sha256": sha, "num_tensors": 2, "param_count": 1, "time": 0.0}
        return encode_state_meta({**meta, "pending_tensors": 0})

    async def scenario() -> tuple[list[str], list[str], float]:
        sync: Any = object.__new__(StateSync)
        sync.settings = sync_settings(load_config(None, ["net.status_interval=1"]))
        sync.seen, sync._judging = {}, set()
        started = time.monotonic()
        early = [record("p1", 6), record("p2", 6), record("liar", 6)]
        late = [record("p1", 7, B), record("p2", 7, B), record("liar", 7, B), record("early", 7, B)]

        async def records() -> list[dict[str, Any]]:
            return early if time.monotonic() - started < 0.6 else late

        punished: list[str] = []

        async def punish(liars: list[tuple[str, str]]) -> None:
            punished.extend(d for d, _ in liars)

        sync.ports = ports(records=records, punish=punish)
        await sync.others()
        tried: list[str] = []
        outvoted = {"liar": head(7, C), "early": head(8, C), "stale": head(6, C)}
        await sync._hold_outvoted(outvoted, tried)
        held = list(tried)  # nothing to judge step 7 or 8 by yet; step 6's records prove "stale" lied
        await asyncio.gather(*sync._judging)
        return held, punished, time.monotonic() - started

    held, punished, took = asyncio.run(scenario())
    assert held == ["stale"]
    # "liar" reported B at step 7 and declared C; "early" is ahead of every record: nothing proves a lie
    assert sorted(punished) == ["liar", "stale"]
    assert took < 3.5  # bounded by the records' wait (RECORD_WAITS status intervals)
