"""`dilocod export` and `dilocod generate` of a `model.hf_config` run: `save_pretrained`'s layout of the pinned
architecture (tiny GPT-2 and Qwen2 here), loaded by `AutoModelForCausalLM.from_pretrained` with θ_global's
logits, and sampled alike from the run and from its export. Uses the real `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from dilocod.config import load_config
from dilocod.diloco.outer import global_sha256
from dilocod.export.errors import ExportError
from dilocod.export.export import PROVENANCE_FILE, export_run
from dilocod.export.generate import generate
from dilocod.export.hfexport import check_hf_params, hf_model_of
from dilocod.manifest.pinhf import pin_hf_config
from dilocod.manifest.record import issue
from dilocod.statesync.checkpoint import save_checkpoint
from dilocod.trainer.lm import build_lm, hf_config_sha256, model_name
from peers.auth import Identity
from tests.hfdirs import gpt2_dir, qwen2_dir


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    key = tmp_path_factory.mktemp("key") / "id.key"
    P2P.generate_identity(str(key))
    return Identity.load(key)


def make_hf_run(run_dir: Path, identity: Identity, config_dir: Path) -> list[torch.Tensor]:
    """A run dir of a `model.hf_config` run (byte tokenizer) as a peer leaves it; θ_global returned."""
    sets = [
        'run.id="hfrun"',
        f'model.hf_config="{config_dir}"',
        "model.vocab_size=256",
    ]  # as pin_dataset sets
    config = pin_hf_config(load_config(None, sets), 256)
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.bin").write_bytes(issue(config, identity).encode())
    model = build_lm(config.model, seed=1)
    gen = torch.Generator().manual_seed(1)
    params = [
        p.detach() + torch.randn(p.shape, generator=gen) * 0.05 for p in model.parameters()
    ]  # "trained"
    outer = {"step": 4, "params": params, "momentum": [torch.zeros_like(p) for p in params]}
    state = {
        "run_id": "hfrun", "preset": config.model.preset, "model": model_name(config.model),
        "outer": {**outer, "sha256": global_sha256(params)}, "trainer": {}, "error_feedback": None,
        "tokens": {"trained": 4096, "contributed": 4096}, "counters": {"rounds_ok": 4, "rounds_failed": 0, "resyncs": 0},
    }  # fmt: skip
    save_checkpoint(run_dir, state)
    return params


@pytest.mark.parametrize(("make", "family"), [(gpt2_dir, "gpt2"), (qwen2_dir, "qwen2")])
def test_an_export_loads_in_transformers_with_theta_globals_logits(
    tmp_path: Path, identity: Identity, make: object, family: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_dir = make(tmp_path / "config")  # type: ignore[operator]
    params = make_hf_run(tmp_path / "run", identity, config_dir)
    out = export_run(tmp_path / "run", tmp_path / "out")
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        PROVENANCE_FILE,
    } <= names
    exported = json.loads((out / "config.json").read_text())
    pinned = json.loads((config_dir / "config.json").read_text())
    assert exported["model_type"] == family and exported["vocab_size"] == pinned["vocab_size"] == 320
    assert exported["eos_token_id"] == exported["bos_token_id"] == 0  # the byte tokenizer's end of document
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["hf_config_sha256"] == hf_config_sha256(
        json.dumps(pinned, sort_keys=True, separators=(",", ":"))
    )
    assert (provenance["model_type"], provenance["outer_step"]) == (family, 4)
    assert provenance["global_sha256"] == global_sha256(params)

    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = hf_model_of(params, _pinned_json(config_dir))
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((theirs(idx).logits - ours(idx)).abs().max()) <= 1e-5
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"

    flags = {"max_new_tokens": 10, "temperature": 0.0, "top_k": 0}
    from_run = generate(tmp_path / "run", "def main(", **flags)  # type: ignore[arg-type]
    from_export = generate(out, "def main(", **flags)  # type: ignore[arg-type]
    assert from_run == from_export and isinstance(from_run, str)


def _pinned_json(config_dir: Path) -> str:
    return json.dumps(
        json.loads((config_dir / "config.json").read_text()), sort_keys=True, separators=(",", ":")
    )


def test_theta_of_another_model_is_refused_in_one_line(tmp_path: Path) -> None:
    pinned = _pinned_json(qwen2_dir(tmp_path / "qwen"))
    params = list(
        build_lm(load_config(None, [f"model.hf_config_json={json.dumps(pinned)}"]).model, 0).parameters()
    )
    check_hf_params([p.detach() for p in params], pinned)
    with pytest.raises(ExportError, match=r"^\d+ tensors, but the model has \d+ parameters$"):
        check_hf_params(params[:-1], pinned)
    with pytest.raises(
        ExportError, match=r"^model.embed_tokens.weight has shape \(256, 64\), the model's is \(320, 64\)$"
    ):
        check_hf_params([torch.zeros(256, 64), *params[1:]], pinned)
