"""dilocod.export: our model as a Hugging Face Llama (same logits), back again bit for bit, a run dir's export
with its tokenizer and provenance, sampling, and each bad input's one line. Uses the real `transformers`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from dilocod.config import load_config
from dilocod.data.prepare import prepare
from dilocod.data.tokenizer import padded_vocab, train_bpe
from dilocod.diloco.outer import global_sha256
from dilocod.export.errors import ExportError
from dilocod.export.export import PROVENANCE_FILE, export_run, write_model
from dilocod.export.generate import generate, sample
from dilocod.export.hf import WEIGHTS_FILE, from_llama, matching_preset, to_llama
from dilocod.manifest.record import issue
from dilocod.statesync.checkpoint import CheckpointError, UnreadableCheckpoint, save_checkpoint
from dilocod.trainer.model import PRESETS, ModelConfig, ModelSpec, Transformer, build_model, init_weights
from peers.auth import Identity

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n\tdef f(x): return x  # ok",
    "Ünïcödé, 日本語のテキスト, emoji 🎉, and Ā (byte 0's symbol) and a NUL \x00 byte",
    "",
]
SAMPLE = "Pack my box with five dozen liquor jugs. The five boxing wizards jump quickly.\n"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    key = tmp_path_factory.mktemp("key") / "id.key"
    P2P.generate_identity(str(key))
    return Identity.load(key)


def trained_like(preset: str = "tiny", vocab: int = 0, seed: int = 1) -> Transformer:
    """A model whose weights are not at init (norms away from 1), as a trained one's are not."""
    model = build_model(ModelConfig(preset, vocab), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def make_run(
    run_dir: Path, identity: Identity, *, vocab: int = 0, dataset: str = "", model: Transformer | None = None
) -> list[torch.Tensor]:
    """A peer's run dir as `checkpoint_payload` and the manifest store leave it; θ_global returned."""
    overrides = ['run.id="exported"', 'model.preset="tiny"', f"model.vocab_size={vocab}"]
    config = load_config(None, [*overrides, f'data.dataset="{dataset}"'] if dataset else overrides)
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.bin").write_bytes(issue(config, identity).encode())
    params = [p.detach().clone() for p in (model or trained_like(vocab=vocab)).state_dict().values()]
    outer = {"step": 7, "params": params, "momentum": [torch.zeros_like(p) for p in params]}
    state = {
        "run_id": "exported", "preset": "tiny", "outer": {**outer, "sha256": global_sha256(params)},
        "trainer": {}, "error_feedback": None, "tokens": {"trained": 123456, "contributed": 100000},
        "counters": {"rounds_ok": 7, "rounds_failed": 0, "resyncs": 0},
    }  # fmt: skip
    save_checkpoint(run_dir, state)
    return params


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset with a small BPE trained here (no network)."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(SAMPLE * (2 + i) + TEXTS[0] + TEXTS[1] + f" {i}\n", "utf-8")
    tokenizer = train_bpe([corpus], 300, root / "tokenizer.json")
    prepare([corpus], tokenizer, root / "data", eval_fraction=0.3, progress=False)
    return root / "data"


def ours_vs_hf(model: Transformer, hf_model: torch.nn.Module, length: int = 200) -> float:
    idx = torch.randint(0, model.spec.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((model(idx) - hf_model(idx).logits).abs().max())


# ---------------------------------------------------------------- the mapping


@pytest.mark.parametrize("vocab", [0, 512], ids=["byte-256", "bpe-512"])
def test_hf_llama_computes_our_logits_and_generates_our_greedy_text(vocab: int) -> None:
    from transformers import LlamaForCausalLM

    model = trained_like(vocab=vocab)
    config, tensors = to_llama(model.state_dict(), model.spec, bos_id=0, eos_id=0)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(tensors, strict=True)
    assert ours_vs_hf(model, hf) <= 1e-5
    assert ours_vs_hf(model, hf, length=model.spec.max_seq_len) <= 1e-5  # every rotary position

    prompt = [5, 17, 99, 3]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    theirs = out[0, len(prompt) :].tolist()
    kw = {"temperature": 0.0, "top_k": 0, "seed": 0, "eos": -1, "vocab": model.spec.vocab_size}
    assert sample(model, prompt, 12, **kw) == theirs


def test_import_then_export_is_bit_identical(tmp_path: Path) -> None:
    model = trained_like(vocab=512)
    params = list(model.state_dict().values())
    (tmp_path / "a").mkdir()
    write_model(tmp_path / "a", params, model.spec, eos=0)
    spec, back = from_llama(tmp_path / "a")
    assert spec == model.spec and matching_preset(spec) == "tiny"
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(back, params))
    (tmp_path / "b").mkdir()
    write_model(tmp_path / "b", back, spec, eos=0)
    assert (tmp_path / "a" / WEIGHTS_FILE).read_bytes() == (tmp_path / "b" / WEIGHTS_FILE).read_bytes()
    _, again = to_llama(back, spec)
    _, first = to_llama(params, spec)
    assert all(torch.equal(again[k], first[k]) for k in first)


# Every preset shape family at a reduced size: (vocabulary, heads, key/value heads, tied, rope_theta, eps).
FAMILIES = {
    "byte-untied": ModelSpec(256, 64, 2, 4, 96, 128),  # the byte presets' family (tiny, small, 124m, 1b)
    "bpe-tied-gqa": dataclasses.replace(  # llama-20m, llama-150m
        PRESETS["llama-20m"], vocab_size=320, d_model=96, n_layers=2, n_heads=6, ffn_hidden=160, max_seq_len=128
    ),
    "bpe-untied-gqa": dataclasses.replace(  # llama-1b
        PRESETS["llama-1b"], vocab_size=384, d_model=128, n_layers=2, n_heads=8, n_kv_heads=1, ffn_hidden=192,
        max_seq_len=128,
    ),
    "bpe-tied-theta": ModelSpec(320, 64, 2, 4, 96, 128, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5),
}  # fmt: skip


def family_model(spec: ModelSpec, seed: int = 2) -> Transformer:
    model = Transformer(spec)
    init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_in_transformers_with_our_logits_and_imports_back_bit_identical(
    family: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    spec = FAMILIES[family]
    model = family_model(spec)
    params = list(model.state_dict().values())
    write_model(tmp_path / "a", params, spec, eos=0)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (
        spec.n_kv_heads,
        spec.tie_embeddings,
    )
    assert (config["rope_parameters"]["rope_theta"], config["rms_norm_eps"]) == (
        spec.rope_theta,
        spec.norm_eps,
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).eval()
    assert ours_vs_hf(model, hf, length=spec.max_seq_len) <= 1e-5

    back_spec, back = from_llama(tmp_path / "a")
    assert back_spec == spec
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(back, params, strict=True))
    write_model(tmp_path / "b", back, back_spec, eos=0)
    assert (tmp_path / "a" / WEIGHTS_FILE).read_bytes() == (tmp_path / "b" / WEIGHTS_FILE).read_bytes()


def test_a_tied_checkpoint_that_also_stores_its_head_imports_when_the_head_is_the_embedding() -> None:
    spec = FAMILIES["bpe-tied-gqa"]
    config, tensors = to_llama(family_model(spec).state_dict(), spec)
    assert "lm_head.weight" not in tensors  # as transformers saves a tied model
    embed = tensors["model.embed_tokens.weight"]
    assert from_llama((config, {**tensors, "lm_head.weight": embed.clone()}))[0] == spec
    with pytest.raises(ExportError, match="lm_head.weight differs"):
        from_llama((config, {**tensors, "lm_head.weight": embed + 1}))


# ---------------------------------------------------------------- a run's export


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory: pytest.TempPathFactory, identity: Identity) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("byte-run")
    make_run(root / "run", identity)
    yield root / "run", export_run(root / "run", root / "out")


def test_export_writes_a_loadable_model_with_its_provenance(byte_export: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    run_dir, out = byte_export
    names = {p.name for p in out.iterdir()}
    assert {"config.json", WEIGHTS_FILE, "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", PROVENANCE_FILE} <= names
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    meta = json.loads((out / PROVENANCE_FILE).read_text())
    assert meta["run_id"] == "exported" and meta["outer_step"] == 7 and meta["tokens_trained"] == 123456
    assert meta["global_sha256"] == saved["outer"]["sha256"] and meta["checkpoint"] == "checkpoint.pt"
    assert len(meta["manifest_hash"]) == 64 and meta["dataset"] is None and meta["eos_token_id"] == 0

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    model = Transformer(ModelConfig("tiny").spec())
    model.load_state_dict(dict(zip(model.state_dict(), saved["outer"]["params"])))
    assert ours_vs_hf(model.eval(), hf) <= 1e-5


def test_byte_tokenizer_round_trips_through_autotokenizer(byte_export: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(byte_export[1])
    assert tok.eos_token_id == 0
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8"))  # the byte tokenizer: id of byte b is b
        assert tok.decode(ids) == text


def test_bpe_run_exports_its_dataset_tokenizer(tmp_path: Path, identity: Identity, bpe_data: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from dilocod.data.shards import load_index

    index = load_index(bpe_data)
    vocab = padded_vocab(index.vocab_size)
    make_run(tmp_path / "run", identity, vocab=vocab, dataset=index.hash)
    out = export_run(tmp_path / "run", tmp_path / "out", data_path=bpe_data)
    meta = json.loads((out / PROVENANCE_FILE).read_text())
    assert meta["dataset"] == index.hash and meta["vocab_size"] == vocab
    assert meta["tokenizer_vocab_size"] == index.vocab_size and meta["eos_token_id"] == index.eos_id

    tok = AutoTokenizer.from_pretrained(out)
    ours = Tokenizer.from_file(str(bpe_data / "tokenizer.json"))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == index.eos_id
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text).ids and tok.decode(ids) == text
    assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab


def test_generate_samples_alike_from_the_run_and_its_export(byte_export: tuple[Path, Path]) -> None:
    run_dir, out = byte_export
    kw = {"max_new_tokens": 16, "temperature": 0.8, "top_k": 50, "seed": 3}
    text = generate(run_dir, "The quick", **kw)
    assert text == generate(out, "The quick", **kw)
    assert text != generate(out, "The quick", **{**kw, "seed": 4})
    assert generate(out, "", max_new_tokens=4, temperature=0.0) == generate(out, "", 4, 0.0, seed=9)


def test_newest_damaged_checkpoint_falls_back_to_the_previous(tmp_path: Path, identity: Identity) -> None:
    run_dir = tmp_path / "run"
    params = make_run(run_dir, identity)
    (run_dir / "checkpoint.pt").rename(run_dir / "checkpoint.prev.pt")
    (run_dir / "checkpoint.pt").write_bytes(b"\x00garbage")
    meta = json.loads((export_run(run_dir, tmp_path / "out") / PROVENANCE_FILE).read_text())
    assert meta["checkpoint"] == "checkpoint.prev.pt" and meta["global_sha256"] == global_sha256(params)
    assert (run_dir / "checkpoint.pt").read_bytes() == b"\x00garbage"  # read only: nothing moved aside


# ---------------------------------------------------------------- bad inputs: one line each


def one_line(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def test_out_dir_that_is_not_empty(tmp_path: Path, byte_export: tuple[Path, Path]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError) as e:
        export_run(byte_export[0], tmp_path / "out")
    assert "not empty" in one_line(e) and (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert (export_run(byte_export[0], tmp_path / "empty") / WEIGHTS_FILE).is_file()  # empty is fine


def test_run_dir_without_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(ExportError) as e:
        export_run(tmp_path / "run", tmp_path / "out")
    assert "no checkpoint.pt" in one_line(e) and not (tmp_path / "out").exists()
    with pytest.raises(ExportError) as e:
        export_run(tmp_path / "nowhere", tmp_path / "out")
    assert "no such run directory" in one_line(e)


def test_damaged_checkpoint(tmp_path: Path, identity: Identity) -> None:
    make_run(tmp_path / "run", identity)
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(UnreadableCheckpoint) as e:
        export_run(tmp_path / "run", tmp_path / "out")
    assert "unreadable" in one_line(e) and not (tmp_path / "out").exists()


def test_checkpoint_whose_global_does_not_match_its_hash(tmp_path: Path, identity: Identity) -> None:
    make_run(tmp_path / "run", identity)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    state["outer"]["params"][0][0, 0] += 1.0
    save_checkpoint(tmp_path / "run", {k: v for k, v in state.items() if k not in ("format", "version")})
    with pytest.raises(CheckpointError) as e:
        export_run(tmp_path / "run", tmp_path / "out")
    assert "does not match its sha256" in one_line(e)


def test_bpe_run_without_its_tokenizer(tmp_path: Path, identity: Identity) -> None:
    make_run(tmp_path / "run", identity, vocab=512)
    with pytest.raises(ExportError) as e:
        export_run(tmp_path / "run", tmp_path / "out")
    assert "--data-path" in one_line(e)


def test_damaged_safetensors_on_import(tmp_path: Path, byte_export: tuple[Path, Path]) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(byte_export[1], copy)
    blob = (copy / WEIGHTS_FILE).read_bytes()
    (copy / WEIGHTS_FILE).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ExportError) as e:
        from_llama(copy)
    assert "not a readable safetensors file" in one_line(e)
    (copy / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(ExportError) as e:
        from_llama(copy)
    assert WEIGHTS_FILE in one_line(e)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "not a Llama model"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "not a Llama causal LM"),
        ({"num_key_value_heads": 3}, "groups of 3 key/value heads"),  # 4 heads: GQA itself is ours
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}}, "rotary embeddings of type"),
    ],
)
def test_config_that_is_not_our_llama_on_import(change: dict[str, object], words: str) -> None:
    model = trained_like()
    config, tensors = to_llama(model.state_dict(), model.spec)
    with pytest.raises(ExportError) as e:
        from_llama(({**config.to_dict(), **change}, tensors))
    assert words in one_line(e)


def test_weights_that_do_not_fit_their_config_on_import() -> None:
    model = trained_like()
    config, tensors = to_llama(model.state_dict(), model.spec)
    with pytest.raises(ExportError) as e:
        from_llama((config, {k: v for k, v in tensors.items() if k != "lm_head.weight"}))
    assert "missing lm_head.weight" in one_line(e)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ExportError) as e:
        from_llama((config, tensors))
    assert "k_proj.weight is (3, 3)" in one_line(e)
