"""A `model.hf_config` run through the CLI: the bootstrap pins a tiny Qwen2 config; a peer given the run's
config file and a bare peer (the bootstrap's address only, never the directory) build the same θ_global at
outer step 0 from the manifest, train it to identical θ_global, and one peer's run dir exports a directory
that `transformers` loads with θ_global's exact parameters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dilocod.diloco.outer import global_sha256
from dilocod.export.export import export_run
from dilocod.manifest.pinhf import read_config_dir
from dilocod.trainer.lm import build_lm, hf_config_sha256
from dilocod.trainer.model import ModelConfig
from tests.harness import Swarm, round_hashes, round_results, wait_for
from tests.hfdirs import qwen2_dir

pytestmark = pytest.mark.integration


# The line a peer logs as it joins: its outer step and the θ_global it holds then.
JOINED = re.compile(r"joined run '\w+' at outer step (\d+) \(inner step \d+, θ (\w+)\)")


@pytest.mark.timeout(300)  # ~60 s on 2 idle cores
def test_two_peers_train_a_qwen2_config_to_one_theta_and_export_it(tmp_path: Path) -> None:
    config_dir = qwen2_dir(tmp_path / "qwen2")
    pinned = read_config_dir(config_dir)
    theta0 = global_sha256(
        [p.detach() for p in build_lm(ModelConfig(hf_config_json=pinned), seed=0).parameters()]
    )
    s = Swarm(tmp_path)
    try:
        s.start_bootstrap("dilocod", "--set", f'model.hf_config="{config_dir}"')
        peers = [s.add_peer(), s.add_peer(bare=True)]

        def built() -> list[str] | None:
            for proc in peers:
                assert proc.alive, f"{proc.name} exited"
            joined = [JOINED.search(proc.output()) for proc in peers]
            return [f"{m[1]} {m[2]}" for m in joined if m] if all(joined) else None

        # Both built θ_global at step 0 from the pinned config alone, bit for bit. Read from the line each
        # logs as it joins: a peer alone in the run may have applied its own step by the time a status is read.
        assert wait_for("both peers to join", built, 120, 0.2) == [f"0 {theta0[:12]}"] * 2
        statuses = s.wait_all_at(3, timeout=180)
        by_step = round_hashes(statuses)
        assert all(len(hashes) == 1 for hashes in by_step.values()), round_results(statuses)
        assert {1, 2, 3} <= set(by_step), round_results(statuses)
        for proc in peers:
            assert f"hf qwen2 {hf_config_sha256(pinned)[:12]}" in proc.output()  # the joined line names it
        peers[0].stop()
        assert peers[0].run_dir is not None
        # in-process (transformers is imported already): a fresh CLI process's imports alone took > 120 s
        # on 2 cores beside a busy loop and a loaded machine; the CLI is tested in test_export_cli.py
        out = export_run(peers[0].run_dir, tmp_path / "exported")
    except AssertionError as e:  # every process's last words, for a failure seen only on a busy machine
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        s.close()
    provenance = json.loads((out / "dilocod.json").read_text())
    assert provenance["global_sha256"] in by_step.get(provenance["outer_step"], {provenance["global_sha256"]})
    assert provenance["hf_config_sha256"] == hf_config_sha256(pinned) and provenance["outer_step"] >= 3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert global_sha256([p.detach() for p in model.parameters()]) == provenance["global_sha256"]
