"""`dilocod export --from MADDR`: the run's θ_global taken from a running swarm through the CLI, checked against
the hashes its peers report (a donor that serves another θ is refused and the next one tried), loaded by the
real `transformers`; and its one-line errors (a maddr that does not answer, a run without peers)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dilocod.config import Config
from dilocod.diloco.outer import global_sha256
from dilocod.export.hf import from_llama
from dilocod.node import exportfrom
from dilocod.node.exportfrom import WATCH_SECONDS, _Download, agreement, named_params_shapes
from dilocod.trainer.model import ModelConfig
from peers.group import DownloadedState
from proto import encode_state_meta
from tests.harness import REPO, Swarm, round_hashes

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

SILENT_MADDR = "/ip4/127.0.0.1/tcp/9/p2p/QmXZWgfKCKPkfzqZkMNzi6SJrXcavDk9frk8d1NBhaQbjv"


def test_the_steps_reported_while_a_state_downloads_are_what_it_is_held_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record says only its peer's latest step, and a download can outlast rounds: the donor's step is
    reported (by every peer, with its θ) only while its state downloads, and the run is past it once the
    state is in. The export reads the records throughout, so it holds the state to those reports."""
    cfg = Config()
    model = ModelConfig(cfg.model.preset, cfg.model.vocab_size)
    params = [torch.full(t.shape, 0.5) for t in named_params_shapes(model)]
    sha = global_sha256(params)
    began = time.monotonic()
    round_seconds = WATCH_SECONDS * 1.2  # every step is read at least once

    def step_now() -> int:
        return int((time.monotonic() - began) / round_seconds)

    async def read_run(_node: object) -> list[dict[str, Any]]:
        step = step_now()
        return [
            {"role": "peer", "manifest_hash": "m", "peer_id": f"p{i}", "outer_step": step,
             "global_sha256": sha if step == 1 else f"{step:064x}"}
            for i in range(3)
        ]  # fmt: skip

    class Donor:
        async def download_state(self, **_: Any) -> DownloadedState:
            while step_now() < 1:
                await asyncio.sleep(0.05)
            meta = encode_state_meta(
                {"outer_step": 1, "global_sha256": sha, "num_tensors": len(params), "param_count": len(params),
                 "time": time.time()}
            )  # fmt: skip
            while step_now() < 4:  # the download takes rounds
                await asyncio.sleep(0.05)
            return DownloadedState("donor", 1.0, meta, params)

    monkeypatch.setattr(exportfrom, "read_run", read_run)
    manifest = SimpleNamespace(hash="m", run_id="run")
    download = _Download(cfg, manifest, model, None, Donor())  # type: ignore[arg-type]
    got = asyncio.run(download.run())
    assert (got.outer_step, got.global_sha256) == (1, sha)
    assert got.swarm == {"donor": "donor", "peers_agreeing": 3, "peers_reporting": 3}


def export_from(maddr: str, out: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return BackgroundExport(maddr, out, *extra).wait(timeout)


class BackgroundExport:
    """`dilocod export --from maddr` started in the background; `wait` collects it (killed after)."""

    def __init__(self, maddr: str, out: Path, *extra: str) -> None:
        self.args = [sys.executable, "-m", "dilocod", "export", "--from", maddr, "--out", str(out), *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            self.args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            out, err = self.popen.communicate(timeout=timeout)
        finally:
            self.popen.kill()
        return subprocess.CompletedProcess(self.args, self.popen.returncode, out, err)


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_agreement_needs_more_than_half_of_the_reports_for_that_step() -> None:
    seen = {3: {"a": "h", "b": "h", "c": "x"}, 4: {"a": "y", "b": "z"}}
    assert agreement(seen, 3, "h").majority and not agreement(seen, 3, "x").majority
    assert not agreement(seen, 4, "y").majority  # one of two: a tie is no majority
    assert (agreement(seen, 5, "h").agreeing, agreement(seen, 5, "h").reporting) == (0, 0)


def test_export_from_a_running_swarm(tmp_path: Path) -> None:
    # A maddr that does not answer: said in one line once its wait is over (the swarm starts meanwhile).
    silent = BackgroundExport(SILENT_MADDR, tmp_path / "none")
    s = Swarm(tmp_path)
    try:
        s.start_bootstrap()
        # A run with no trainer yet: nothing to export, said in one line once `--wait` is over.
        early = error_line(export_from(s.maddr, tmp_path / "early", "--wait", "3"))
        assert "holds a θ_global" in early and "record in 3s" in early, early
        # The bad donor claims the highest step and serves a poisoned θ_global that matches its own hash.
        s.add_peer()
        s.add_peer("adversary.mode=bad_donor")
        assert "does not answer" in error_line(silent.wait(60))
        s.wait_all_at(2, timeout=150)
        done = export_from(s.maddr, tmp_path / "model")
        assert done.returncode == 0, done.stderr[-3000:]
        check_export(s, tmp_path / "model", done.stderr)
    except AssertionError as e:  # every process's last words, for a failure seen only on a busy machine
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        silent.popen.kill()
        s.close()


def check_export(s: Swarm, out: Path, stderr: str) -> None:
    meta = json.loads((out / "dilocod.json").read_text())
    honest = s.peers[0].status()
    reported = round_hashes([honest])
    reported.setdefault(honest["outer_step"], set()).add(honest["global_sha256"])
    assert meta["global_sha256"] in reported.get(meta["outer_step"], set()), (meta, reported)
    assert meta["run_id"] == "dilocod" and meta["manifest_hash"] == honest["manifest_hash"]
    assert meta["swarm"]["peers_agreeing"] * 2 > meta["swarm"]["peers_reporting"]
    assert "refused the state of" in stderr  # the bad donor, tried first for the step it claims
    _, params = from_llama(out)
    assert global_sha256(params) == meta["global_sha256"]  # the file holds exactly that θ_global
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("def main():", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
    assert tok.decode(ids[0]) == "def main():"
