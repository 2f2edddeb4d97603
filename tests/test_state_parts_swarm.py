"""Through the CLI: a peer that joins a running swarm downloads θ_global and the momentum in parts from
both of the run's peers at once, and trains on with the run's θ_global. The run takes FedAdam outer steps
(`outer.optimizer = "fedadam"`), so its state also holds the second moments: three model-sized sets."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from dilocod.config import load_config
from dilocod.trainer.lm import lm_skeleton
from dilocod.trainer.model import count_params
from tests.harness import Swarm, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_a_joiner_downloads_the_state_in_parts_from_two_donors(swarm: Callable[..., Swarm]) -> None:
    # Rounds of 150 inner steps (~10 s on 2 shared cores), not 5: a download planned just as one donor
    # finished a round and the other had not finds them at two steps, and takes the newer state from the
    # one donor that has it (CI saw it with ~2 s rounds: the status then shows that second download).
    s = swarm(2, "trainer.inner_steps=150", "outer.optimizer=fedadam", "outer.momentum=0.9")
    try:
        s.wait_all_at(1, timeout=120)
        donors = {p.status()["peer_id"] for p in s.peers}
        joiner = s.add_peer()
        s.wait_serving(joiner)
        fetch = wait_for(
            "the joiner's state download in parts",
            lambda: (f := joiner.status().get("state_fetch")) and not f["active"] and f,
            90,
        )
        # every part came from one of the two donors, and each of them sent some
        assert fetch["error"] is None, fetch
        assert set(fetch["parts_from"]) == donors, fetch
        assert sum(fetch["parts_from"].values()) == fetch["parts_total"] > 1, fetch
        assert fetch["bytes_done"] == fetch["bytes_total"] and not fetch["banned"], fetch
        # θ_global, the first and the second moments, fp32
        assert fetch["bytes_total"] == 3 * 4 * count_params(lm_skeleton(load_config(None).model)), fetch
        assert joiner.run_dir is not None
        pattern = re.compile(r"re-synced to outer step (\d+) from \S+ \(θ ([0-9a-f]{12})\)")
        found = wait_for(  # adopted once the hash is checked against the run's records
            "the joiner to adopt the state",
            lambda: pattern.search((joiner.run_dir / "dilocod.log").read_text()),  # type: ignore[operator]
            30,
        )
        assert "from 2 donors" in (joiner.run_dir / "dilocod.log").read_text()
        step, theta = int(found[1]), found[2]
        held = {
            e["global_sha256"][:12]
            for p in s.peers[:2]
            for e in p.status()["rounds"]
            if e["outer_step"] == step and e["result"] == "ok"
        }
        assert held == {theta}, (step, theta, held)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
