"""dilocod.data.tokenizer: the byte tokenizer, loading tokenizer.json files, training a byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from dilocod.data.errors import DataError
from dilocod.data.tokenizer import (
    BYTE,
    byte_tokenizer,
    eos_id,
    load_tokenizer,
    padded_vocab,
    tokenizer_json,
    train_bpe,
)

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "def main(argv):\n    return sum(int(a) for a in argv)  # numbers\n"
    "Ünïcödé text, 日本語のテキスト, emoji 🎉 and tabs\tand newlines.\n"
)


def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(8):
        (root / f"doc{i}.txt").write_text(SAMPLE * (3 + i) + f"document number {i}\n", encoding="utf-8")
    return root


def test_byte_tokenizer_ids_are_the_bytes() -> None:
    tok = byte_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 256
    every_byte_text = bytes(range(128)).decode("ascii") + "é€𝄞"
    assert tok.encode(every_byte_text).ids == list(every_byte_text.encode("utf-8"))
    assert eos_id(tok) == 0


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_tokenizer_roundtrips_any_text(text: str) -> None:
    tok = byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_json_is_fixed_and_what_the_library_writes() -> None:
    raw = tokenizer_json(BYTE)
    assert raw == tokenizer_json("byte")
    assert raw.endswith(b"\n") and raw.isascii()
    # The hand-written JSON is exactly the library's own serialisation, canonicalised.
    library = json.loads(byte_tokenizer().to_str())
    assert raw == (json.dumps(library, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def test_train_bpe_loads_roundtrips_and_is_deterministic(tmp_path: Path) -> None:
    root = corpus(tmp_path)
    out = train_bpe([root], 300, tmp_path / "tok.json")
    again = train_bpe([root], 300, tmp_path / "again.json")
    assert out.read_bytes() == again.read_bytes()
    tok = load_tokenizer(out)
    assert tok.get_vocab_size(with_added_tokens=True) == 300
    ids = tok.encode(SAMPLE, add_special_tokens=False).ids
    assert len(ids) < len(SAMPLE.encode("utf-8"))  # it learned merges
    assert tok.decode(ids) == SAMPLE
    assert eos_id(tok) == tok.token_to_id("<|endoftext|>")
    assert tokenizer_json(out) == out.read_bytes()


def test_train_bpe_reads_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": SAMPLE * 2}) + "\n" for _ in range(4)), encoding="utf-8")
    tok = load_tokenizer(train_bpe([src], 280, tmp_path / "t.json", text_field="body"))
    assert tok.decode(tok.encode(SAMPLE).ids) == SAMPLE


def test_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="at least 257"):
        train_bpe([corpus(tmp_path)], 100, tmp_path / "t.json")


def test_tokenizer_file_that_does_not_load(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "nonsense"}', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_tokenizer(bad)
    assert str(e.value).startswith(f"{bad}: not a loadable tokenizer.json")
    assert "\n" not in str(e.value)


def test_tokenizer_file_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "nope.json")


def test_eos_id_candidates_and_none() -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert eos_id(tok) == 2
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    with pytest.raises(DataError, match="no end-of-document token"):
        eos_id(plain)


def test_padded_vocab() -> None:
    assert [padded_vocab(n) for n in (1, 64, 65, 256, 4097, 50257)] == [64, 64, 128, 256, 4160, 50304]
