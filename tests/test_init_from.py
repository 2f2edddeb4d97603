"""`dilocod bootstrap --init-from HF_DIR`: a run that starts from a Hugging Face Llama checkpoint. Through the
CLI, θ_global at outer step 0 is the checkpoint's weights on every peer (a bare joiner fetches them from the
bootstrap); each bad directory is one line and exit code 2, before any network starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dilocod.diloco.outer import global_sha256
from dilocod.export.export import write_model
from dilocod.export.hf import WEIGHTS_FILE
from dilocod.export.initial import load_init
from dilocod.files import file_sha256
from dilocod.trainer.model import ModelConfig, ModelSpec, Transformer, build_model
from tests.harness import REPO, Proc, Swarm, wait_for
from tests.tools import run_main

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

TINY = str(REPO / "configs" / "tiny.toml")


def llama_dir(where: Path, spec: ModelSpec | None = None, seed: int = 5) -> Path:
    """A Hugging Face Llama directory whose weights are far from any seed's init."""
    model = Transformer(spec) if spec is not None else build_model(ModelConfig("tiny"), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.03 + (1.0 if p.ndim == 1 else 0.0))
    write_model(where, list(model.state_dict().values()), model.spec, eos=0)
    return where


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


def bootstrap_error(capsys: pytest.CaptureFixture[str], directory: Path) -> str:
    code, err = run_main(capsys, "bootstrap", "--host", "127.0.0.1", "--port", "0", "--config", TINY,
                         "--init-from", str(directory))  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dilocod: error: --init-from: "), err
    return lines[0]


def edited(checkpoint: Path, where: Path, **changes: object) -> Path:
    shutil.copytree(checkpoint, where)
    cfg = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**cfg, **changes}))
    return where


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model_type": "gpt2"}, "not a Llama model"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "not a Llama causal LM"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}}, "rotary embeddings of type"),
    ],
)
def test_a_directory_of_another_architecture_is_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    checkpoint: Path,
    changes: dict[str, object],
    words: str,
) -> None:
    assert words in bootstrap_error(capsys, edited(checkpoint, tmp_path / "other", **changes))


def test_another_vocabulary_or_shape_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bpe = llama_dir(tmp_path / "bpe", ModelConfig("tiny", 512).spec())
    assert "a vocabulary of 512 tokens; the run's tokenizer gives the model 256" in bootstrap_error(
        capsys, bpe
    )
    wider = ModelSpec(256, 64, 2, 4, 96, 256)
    assert "not the run's model.preset: d_model 64 (the run's 128)" in bootstrap_error(
        capsys, llama_dir(tmp_path / "wide", wider)
    )


def test_a_tokenizer_with_other_tokens_than_the_runs_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    from dilocod.data.tokenizer import train_bpe

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 50)
    train_bpe([tmp_path / "text"], 260, copy / "tokenizer.json")  # the config still says 256 tokens
    assert "another vocabulary than the run's tokenizer" in bootstrap_error(capsys, copy)


def test_missing_damaged_or_sharded_weights_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    blob = (copy / WEIGHTS_FILE).read_bytes()
    (copy / WEIGHTS_FILE).write_bytes(blob[: len(blob) // 2])
    assert "not a readable safetensors file" in bootstrap_error(capsys, copy)
    (copy / WEIGHTS_FILE).unlink()
    assert f"{WEIGHTS_FILE}: no such file" in bootstrap_error(capsys, copy)
    (copy / "model.safetensors.index.json").write_text("{}")
    assert "sharded checkpoints are not read" in bootstrap_error(capsys, copy)
    (copy / "config.json").unlink()
    assert "no such directory" in bootstrap_error(capsys, tmp_path / "nowhere")


def test_a_run_started_from_a_checkpoint_has_its_weights_at_step_0_on_every_peer(
    tmp_path: Path, checkpoint: Path
) -> None:
    theta0 = load_init(checkpoint / WEIGHTS_FILE, ModelConfig("tiny").spec())
    expected = global_sha256(theta0)  # θ_global's hash as peers report it
    s = Swarm(tmp_path)
    try:
        s.start_bootstrap("dilocod", "--init-from", str(checkpoint))
        peers = [s.add_peer(), s.add_peer(bare=True)]  # the bare one has only the bootstrap's address
        check_started_from(s, peers, expected, file_sha256(checkpoint / WEIGHTS_FILE))
    except AssertionError as e:  # every process's last words, for a failure seen only on a busy machine
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        s.close()


def check_started_from(s: Swarm, peers: list[Proc], theta_sha: str, file_sha: str) -> None:
    assert s.bootstrap is not None
    assert s.bootstrap.status()["init_weights"] == file_sha  # the manifest pins the checkpoint's file

    def at_start() -> list[dict[str, object]] | None:
        for proc in peers:
            assert proc.alive, f"{proc.name} exited"
        statuses = [proc.status() for proc in peers]
        built = all(st.get("global_sha256") not in (None, "0" * 64) for st in statuses)  # trainer built
        return statuses if built else None

    for status in wait_for("both peers' θ_global", at_start, 120, 0.2):
        assert (status["outer_step"], status["global_sha256"]) == (0, theta_sha), status
    s.wait_all_at(1, timeout=120)  # and the run trains on from there
    assert all(p.run_dir is not None and (p.run_dir / "init" / WEIGHTS_FILE).is_file() for p in peers)
    assert "starting from the run's initial weights" in peers[1].output()
    assert f"from weights {file_sha[:12]}" in peers[1].output()  # the run's one-line summary says so
