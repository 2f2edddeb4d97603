"""`model.hf_config`: a transformers causal LM's config.json pinned in the run's manifest, checked in one line,
built bit-identically from the run's seed, and trained by the ordinary trainer (real `transformers`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dilocod.config import Config, ConfigError, load_config
from dilocod.diloco.outer import global_sha256
from dilocod.manifest.pinhf import check_local_hf_config, pin_hf_config, read_config_dir
from dilocod.manifest.record import decode, issue, summary
from dilocod.trainer import InnerTrainer
from dilocod.trainer.batches import Corpus
from dilocod.trainer.hfmodel import HFCausalLM
from dilocod.trainer.lm import build_lm, hf_config_sha256, lm_skeleton, model_name
from dilocod.trainer.model import ModelConfig
from dilocod.trainer.sampling import Sampler
from tests.hfdirs import gpt2_dir, qwen2_dir
from tests.tools import run_main

BYTES = 256  # the byte tokenizer's vocabulary (the run's tokenizer in these tests)


def pinned(directory: Path, *sets: str) -> Config:
    return pin_hf_config(load_config(None, [f'model.hf_config="{directory}"', *sets]), BYTES)


def test_the_config_is_pinned_as_canonical_json_whatever_its_layout(tmp_path: Path) -> None:
    cfg = pinned(gpt2_dir(tmp_path / "gpt2"))
    raw = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert json.loads(cfg.model.hf_config_json) == raw
    assert cfg.model.hf_config_json == json.dumps(raw, sort_keys=True, separators=(",", ":"))
    # the same config written another way (indent, key order) pins the same text, hence the same hash
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "config.json").write_text(json.dumps(dict(reversed(raw.items())), indent=4))
    assert read_config_dir(tmp_path / "again") == cfg.model.hf_config_json
    assert model_name(cfg.model) == f"hf gpt2 {hf_config_sha256(cfg.model.hf_config_json)[:12]}"


def test_the_manifest_carries_the_config_and_a_joiner_needs_no_directory(tmp_path: Path) -> None:
    from peers.auth import ensure_identity

    cfg = pinned(qwen2_dir(tmp_path / "qwen"))
    manifest = decode(issue(cfg, ensure_identity(tmp_path / "id.key")).encode())
    assert manifest.value("model.hf_config_json") == cfg.model.hf_config_json
    assert "model.hf_config" not in manifest.settings["model"]  # the path is local
    assert summary(manifest).startswith(f"hf qwen2 {hf_config_sha256(cfg.model.hf_config_json)[:12]},")
    joiner = load_config(None, [f"model.hf_config_json={json.dumps(manifest.value('model.hf_config_json'))}"])
    assert lm_skeleton(joiner.model).shape.family == "qwen2"
    check_local_hf_config(joiner)  # sets no directory: nothing to compare
    other = replace(joiner, model=replace(joiner.model, hf_config=str(gpt2_dir(tmp_path / "gpt2"))))
    with pytest.raises(ConfigError, match=r"^model.hf_config: .* holds config [0-9a-f]{16}…, the run trains"):
        check_local_hf_config(other)


def bad_dir(where: Path, text: str) -> Path:
    where.mkdir()
    (where / "config.json").write_text(text)
    return where


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p / "nowhere", "no such directory"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "holds no config.json"),
        (lambda p: bad_dir(p / "broken", '{"model_type": "gpt2",'), "config.json is not valid JSON"),
        (lambda p: bad_dir(p / "list", "[1, 2]"), "must hold a JSON object"),
        (lambda p: bad_dir(p / "untyped", '{"vocab_size": 300}'), "names no model_type"),
        (
            lambda p: bad_dir(p / "bert", '{"model_type": "bert"}'),
            "not a causal (decoder-only) language model",
        ),
        (lambda p: bad_dir(p / "t5", '{"model_type": "t5"}'), "'t5' is not a causal language model"),
        (lambda p: bad_dir(p / "vit", '{"model_type": "vit"}'), "'vit' is not a causal language model"),
        (
            lambda p: gpt2_dir(p / "small", vocab=200),
            "vocab_size 200 is smaller than the run's tokenizer's 256",
        ),
    ],
)
def test_bad_directories_are_one_line(tmp_path: Path, make: object, words: str) -> None:
    directory = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError) as caught:
        pinned(directory)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("model.hf_config: ")


def test_a_preset_or_init_from_beside_hf_config_is_one_line(tmp_path: Path) -> None:
    directory = gpt2_dir(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="model.hf_config and model.preset 'small' both name the model"):
        load_config(None, [f'model.hf_config="{directory}"', 'model.preset="small"'])
    with pytest.raises(ConfigError, match=r"model.hf_config and --init-from \(model.init_from\) both"):
        load_config(None, [f'model.hf_config="{directory}"', f'model.init_from="{tmp_path}"'])


def test_the_cli_refuses_a_bad_directory_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    bert = bad_dir(tmp_path / "bert", '{"model_type": "bert", "vocab_size": 30522}')
    for directory, words in ((tmp_path / "empty", "holds no config.json"), (bert, "not a causal")):
        code, err = run_main(
            capsys, "bootstrap", "--host", "127.0.0.1", "--port", "0", "--run-dir", str(tmp_path / "run"),
            "--set", f'model.hf_config="{directory}"',
        )  # fmt: skip
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("dilocod: error: model.hf_config: "), err
        assert words in lines[0]


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("make", [gpt2_dir, qwen2_dir], ids=["gpt2", "qwen2"])
def test_the_seed_alone_fixes_every_parameter(tmp_path: Path, make: object) -> None:
    cfg = pinned(make(tmp_path / "m")).model  # type: ignore[operator]
    torch.manual_seed(1)
    before = torch.random.get_rng_state()
    a = build_lm(cfg, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    torch.manual_seed(99)  # whatever the global RNG holds, the same seed gives the same θ
    b, c = build_lm(cfg, seed=3), build_lm(cfg, seed=4)
    assert isinstance(a, HFCausalLM) and all(p.dtype == torch.float32 for p in a.parameters())
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert global_sha256(pa) == global_sha256(pb) != global_sha256(pc)
    # norms keep their ones and biases their zeros; the matrices are drawn at initializer_range 0.02
    matrices = [p for p in pa if p.ndim == 2]
    assert all(abs(float(p.std()) - 0.02) < 0.004 for p in matrices)
    assert any(bool((p == 1).all()) for p in pa if p.ndim == 1)


def corpus() -> Corpus:
    text = torch.tensor(
        list(("the quick brown fox jumps over the lazy dog. " * 400).encode()), dtype=torch.int64
    )
    return Corpus(train=text[:15000], eval=text[15000:], name="fox")


def trainer_of(cfg: ModelConfig, **trainer_sets: object) -> InnerTrainer:
    sets = [
        f"trainer.{k}={json.dumps(v)}" for k, v in {"batch_size": 4, "seq_len": 32, **trainer_sets}.items()
    ]
    c = load_config(None, sets)
    return InnerTrainer(cfg, c.data, c.trainer, seed=0, peer_key="p", corpus=corpus())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_trainer_trains_a_qwen2_and_its_state_round_trips(tmp_path: Path, optimizer: str) -> None:
    cfg = pinned(qwen2_dir(tmp_path / "qwen")).model
    a, b = trainer_of(cfg, optimizer=optimizer), trainer_of(cfg, optimizer=optimizer)
    assert global_sha256(a.working_params_fp32()) == global_sha256(b.working_params_fp32())  # θ at step 0
    first = a.evaluate()
    stats = a.train_steps(8)
    assert stats.steps == 8 and math.isfinite(stats.mean_loss) and a.evaluate() < first
    # tied head: one tensor, in θ once; the checkpointed state names parameters only
    assert len(a.params()) == len(list(a.model.parameters())) == len(a.state_dict()["model"])
    b.load_state_dict(a.state_dict())
    assert global_sha256(b.working_params_fp32()) == global_sha256(a.working_params_fp32())
    if optimizer == "muon":  # Muon takes the hidden matrices, AdamW the embedding (tied with the head)
        muon = a.optimizer.parts["muon"].param_groups[0]["params"]  # type: ignore[union-attr]
        embedding = a.model.lm.get_input_embeddings().weight  # type: ignore[union-attr]
        assert len(muon) == 2 * 7 and all(p is not embedding for p in muon)


def test_micro_batches_flops_and_a_sample_work_on_a_gpt2(tmp_path: Path) -> None:
    cfg = pinned(gpt2_dir(tmp_path / "gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).model
    whole, pieces = trainer_of(cfg, optimizer="adamw"), trainer_of(cfg, optimizer="adamw", micro_batch_size=1)
    losses = whole.train_steps(2).mean_loss, pieces.train_steps(2).mean_loss
    diff = max(float((x - y).abs().max()) for x, y in zip(whole.params(), pieces.params(), strict=True))
    assert abs(losses[0] - losses[1]) < 1e-5 and diff < 1e-3  # the same steps up to summation order
    shape = whole.model.shape
    assert (shape.family, shape.vocab_size, shape.max_seq_len, shape.n_layers, shape.d_model) == (
        "gpt2", 320, 128, 2, 64,
    )  # fmt: skip
    assert shape.lookup_params == 128 * 64  # positions are looked up; the tied embedding is also the head
    params = sum(p.numel() for p in whole.model.parameters())
    assert whole.flops_per_token == 6 * (params - 128 * 64) + 12 * 2 * 64 * 32
    from dilocod.data.tokenizer import BYTE, eos_id, load_tokenizer

    tok = load_tokenizer(BYTE)
    text = Sampler(tok, "the quick", 8, eos_id(tok))(whole.model)
    assert isinstance(text, str) and whole.model.training  # the sampler leaves training mode as it was
    with pytest.raises(
        ValueError, match=r"trainer.seq_len must be <= 128 \(max_seq_len of the model, hf gpt2"
    ):
        trainer_of(cfg, seq_len=256)


def test_activation_checkpointing_and_compile_flags_reach_the_hf_model(tmp_path: Path) -> None:
    cfg = pinned(qwen2_dir(tmp_path / "qwen")).model
    plain, checkpointed = trainer_of(cfg), trainer_of(cfg, activation_checkpointing=True)
    assert checkpointed.model.activation_checkpointing and checkpointed.model.lm.is_gradient_checkpointing  # type: ignore[union-attr]
    plain.train_steps(2)
    checkpointed.train_steps(2)
    diff = max(float((x - y).abs().max()) for x, y in zip(plain.params(), checkpointed.params(), strict=True))
    assert diff < 1e-5  # recomputation changes memory, not the step
