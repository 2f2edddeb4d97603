"""dilocod.data.prepare and .sources: deterministic, resumable preparation; one-line errors for bad input."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import dilocod.data.prepare as prep
import dilocod.data.prepsplit as prepsplit
import dilocod.data.prepstate as prepstate
from dilocod.data.errors import DataError
from dilocod.data.prepare import prepare
from dilocod.data.shards import TokenStream, load_index, verify_dataset
from dilocod.data.sources import Document, iter_documents
from dilocod.data.tokenizer import load_tokenizer, tokenizer_json, train_bpe

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 13)) + f" #{i} é\n"


def make_sources(root: Path) -> list[Path]:
    """A directory (text files, a nested one, a hidden one, a JSONL inside), a JSONL file, a Parquet file."""
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / ".hidden").mkdir()
    for i in range(12):
        (tree / f"t{i:02d}.txt").write_text(text(i), encoding="utf-8")
    (tree / "sub" / "nested.txt").write_text(text(100), encoding="utf-8")
    (tree / ".hidden" / "skip.txt").write_text("never read", encoding="utf-8")
    (tree / ".dotfile").write_text("never read", encoding="utf-8")
    (tree / "binary.dat").write_bytes(b"\xff\xfe\x00")  # not text: skipped inside a directory
    (tree / "in.jsonl").write_text(json.dumps({"text": text(200)}) + "\n", encoding="utf-8")
    lines = root / "docs.jsonl"
    lines.write_text(
        "".join(json.dumps({"text": text(300 + i), "id": i}) + "\n\n" for i in range(15)), encoding="utf-8"
    )
    table = root / "rows.parquet"
    pq.write_table(
        pa.table({"text": [text(400 + i) for i in range(20)], "n": list(range(20))}), table, row_group_size=7
    )
    return [tree, lines, table]


def is_eval(key: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < fraction


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if not p.name.startswith(".")}


def test_document_keys_follow_the_spec(tmp_path: Path) -> None:
    docs = list(iter_documents(make_sources(tmp_path)))
    keys = [d.key for d in docs]
    assert keys[:3] == ["in.jsonl:1", "sub/nested.txt", "t00.txt"]
    assert "docs.jsonl:1" in keys and "docs.jsonl:29" in keys  # line numbers, blank lines counted
    assert keys[-20:] == [f"rows.parquet:{row}" for row in range(20)]
    assert len(docs) == 1 + 1 + 12 + 15 + 20
    assert docs[1].text == text(100)


def test_byte_prepare_stream_is_the_documents_and_eos(tmp_path: Path) -> None:
    sources = make_sources(tmp_path)
    out = tmp_path / "ds"
    index = prepare(sources, "byte", out, eval_fraction=0.2, shard_tokens=64, progress=False)
    docs = list(iter_documents(sources))
    score = [int.from_bytes(hashlib.sha256(d.key.encode()).digest()[:8], "big") / 2**64 for d in docs]
    for split, want in (("train", False), ("eval", True)):
        texts = [d.text.encode() for d, s in zip(docs, score) if (s < 0.2) == want]
        stream = TokenStream(out, index, split)
        assert stream.read(0, len(stream)).astype(np.uint8).tobytes() == b"\0".join(texts) + b"\0"
        info = index.split(split)
        assert (info.documents, info.text_bytes) == (len(texts), sum(map(len, texts)))
        assert all(s.tokens == 64 for s in info.shards[:-1]) and 0 < info.shards[-1].tokens <= 64
    assert index.eos_id == 0 and index.vocab_size == 256 and index.dtype == "uint16"
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json("byte")
    verify_dataset(out)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepare_is_deterministic(tmp_path: Path, tokenizer: str) -> None:
    sources = make_sources(tmp_path)
    spec: str | Path = "byte" if tokenizer == "byte" else train_bpe(sources, 300, tmp_path / "tok.json")
    a = prepare(sources, spec, tmp_path / "a", eval_fraction=0.1, shard_tokens=100, progress=False)
    b = prepare(
        sources, spec, tmp_path / "b", eval_fraction=0.1, shard_tokens=100, batch_documents=3, progress=False
    )
    assert a.hash == b.hash and a.raw == b.raw
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    assert len(a.train.shards) > 2


def test_bpe_stream_decodes_to_the_documents(tmp_path: Path) -> None:
    sources = make_sources(tmp_path)
    tok_path = train_bpe(sources, 300, tmp_path / "tok.json")
    out = tmp_path / "ds"
    index = prepare(sources, tok_path, out, eval_fraction=0.1, shard_tokens=50, progress=False)
    tok = load_tokenizer(out / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    assert index.eos_id == eos and (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    train = TokenStream(out, index, "train").read(0, index.train.tokens).tolist()
    pieces: list[list[int]] = [[]]
    for t in train:
        pieces[-1].append(t) if t != eos else pieces.append([])
    assert pieces[-1] == [] and len(pieces) - 1 == index.train.documents
    train_docs = [d.text for d in iter_documents(sources) if not is_eval(d.key, 0.1)]
    assert [tok.decode(p) for p in pieces[:-1]] == train_docs


def test_vocabulary_over_65536_gets_uint32(tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["w1 w69999", "w65536 w2", "w65535 w3"]))
    index = prepare([src], tmp_path / "big.json", tmp_path / "ds", eval_fraction=0.5, progress=False)
    assert (index.vocab_size, index.dtype, index.eos_id) == (70_001, "uint32", 70_000)
    got = [
        TokenStream(tmp_path / "ds", index, s).read(0, index.split(s).tokens).tolist()
        for s in ("train", "eval")
    ]
    assert sorted(got[0] + got[1]) == [1, 2, 3, 65535, 65536, 69999, 70000, 70000, 70000]
    assert index.train.shards[0].bytes == 32 + 4 * index.train.tokens


def test_both_splits_are_never_empty(tmp_path: Path) -> None:
    one = tmp_path / "one.txt"
    one.write_text("0123456789" * 10, encoding="utf-8")
    index = prepare([one], "byte", tmp_path / "a", eval_fraction=0.1, progress=False)
    assert (index.train.text_bytes, index.eval.text_bytes) == (90, 10)
    assert (index.train.documents, index.eval.documents) == (1, 1)
    # Few documents and a tiny fraction: the document closest to eval goes there.
    src = tmp_path / "few"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.txt").write_text(f"doc {i}", encoding="utf-8")
    index = prepare([src], "byte", tmp_path / "b", eval_fraction=1e-9, progress=False)
    lowest = min(range(5), key=lambda i: hashlib.sha256(f"{i}.txt".encode()).digest()[:8])
    assert index.eval.documents == 1 and index.train.documents == 4
    assert (
        TokenStream(tmp_path / "b", index, "eval").read(0, index.eval.tokens).astype(np.uint8).tobytes()
        == f"doc {lowest}\0".encode()
    )
    # And the other way round: every document scored eval, the one furthest from it trains.
    index = prepare([src], "byte", tmp_path / "c", eval_fraction=1 - 1e-12, progress=False)
    assert (index.train.documents, index.eval.documents) == (1, 4)


def test_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="no text found"):
        prepare([tmp_path / "empty.txt"], "byte", tmp_path / "ds", progress=False)
    (tmp_path / "x.txt").write_text("x", encoding="utf-8")
    with pytest.raises(DataError, match="one character"):
        prepare([tmp_path / "x.txt"], "byte", tmp_path / "ds2", progress=False)


def bad_input(tmp_path: Path, name: str, content: bytes | None, **kw: Any) -> str:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as e:
        prepare([path], "byte", tmp_path / "out", progress=False, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    assert (
        bad_input(tmp_path, "d.jsonl", b'{"text": "ok"}\n[1, 2]\n')
        == f"{p}:2: expected a JSON object, got list"
    )
    assert (
        bad_input(tmp_path, "d.jsonl", b'{"text": "ok"}\n{"text": \n')
        == f"{p}:2: not valid JSON (Expecting value)"
    )
    assert bad_input(tmp_path, "d.jsonl", b'{"body": "x"}\n') == f"{p}:1: missing string field 'text'"


def test_parquet_without_the_text_column(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", "b"], "id": [1, 2]}), path)
    assert bad_input(tmp_path, "t.parquet", None) == f"{path}: no column 'text' (columns: body, id)"


def test_unreadable_parquet(tmp_path: Path) -> None:
    message = bad_input(tmp_path, "t.parquet", b"PAR1 this is not parquet")
    assert message.startswith(f"{tmp_path / 't.parquet'}: not a readable Parquet file (")


def test_other_bad_sources(tmp_path: Path) -> None:
    assert bad_input(tmp_path, "nope.txt", None) == f"{tmp_path / 'nope.txt'}: no such file or directory"
    assert bad_input(tmp_path, "bin.txt", b"ok\xff") == f"{tmp_path / 'bin.txt'}: not UTF-8 text (byte 2)"
    assert "--eval-fraction" in bad_input(tmp_path, "a.txt", b"abc", eval_fraction=1.5)
    with pytest.raises(DataError, match="no such tokenizer file"):
        prepare([tmp_path / "a.txt"], tmp_path / "missing.json", tmp_path / "o", progress=False)


class Interrupt(Exception):
    pass


# The prepare's modules, each holding its own reference to the functions a test makes fail.
PREPARE_MODULES = (prep, prepsplit, prepstate)


def patch_everywhere(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    for module in PREPARE_MODULES:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def interrupt_after(monkeypatch: pytest.MonkeyPatch, name: str, calls: int) -> None:
    """Make <name> raise on its ``calls``-th call, wherever the prepare calls it: a deterministic kill -9
    at that point."""
    real = next(getattr(m, name) for m in PREPARE_MODULES if hasattr(m, name))
    count = [0]

    def wrapper(*args: Any, **kw: Any) -> Any:
        count[0] += 1
        if count[0] == calls:
            raise Interrupt(name)
        return real(*args, **kw)

    patch_everywhere(monkeypatch, name, wrapper)


@pytest.mark.parametrize(("where", "calls"), [("write_shard", 1), ("write_shard", 6), ("save_state", 6)])
def test_resume_after_interruption_gives_identical_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, calls: int
) -> None:
    sources = make_sources(tmp_path)
    kw: dict[str, Any] = {"eval_fraction": 0.1, "shard_tokens": 60, "batch_documents": 2, "progress": False}
    clean = prepare(sources, "byte", tmp_path / "clean", **kw)
    with monkeypatch.context() as m:
        interrupt_after(m, where, calls)
        with pytest.raises(Interrupt):
            prepare(sources, "byte", tmp_path / "ds", **kw)
    assert not (tmp_path / "ds" / "index.json").exists()
    state = json.loads((tmp_path / "ds" / ".prepare-state.json").read_bytes())
    assert state["consumed"] == 0 if calls == 1 else state["consumed"] > 0
    assert not state["done"]
    # A rerun with other arguments refuses the directory; with the same ones it continues.
    with pytest.raises(DataError, match="holds a prepare of other arguments"):
        prepare(sources, "byte", tmp_path / "ds", **{**kw, "shard_tokens": 61})
    written: list[str] = []
    real = prepsplit.write_shard
    patch_everywhere(monkeypatch, "write_shard", lambda path, *a: written.append(path.name) or real(path, *a))
    resumed = prepare(sources, "byte", tmp_path / "ds", **kw)
    assert resumed.raw == clean.raw
    assert files_of(tmp_path / "ds") == files_of(tmp_path / "clean")
    if calls > 1:
        assert 0 < len(written) < len(clean.files())  # it did continue, not start over
        assert "train-00000.bin" not in written
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")) == [
        ".prepare-state.json"
    ]


def test_finished_dataset_is_up_to_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.txt"
    src.write_text("some text " * 50, encoding="utf-8")
    first = prepare([src], "byte", tmp_path / "ds", shard_tokens=100, progress=False)
    patch_everywhere(monkeypatch, "write_shard", None)  # nothing may be written again
    again = prepare([src], "byte", tmp_path / "ds", shard_tokens=100, progress=False)
    assert again == first and "up to date" in capsys.readouterr().err
    with pytest.raises(DataError, match="holds a prepare of other arguments"):
        prepare([src], "byte", tmp_path / "ds", shard_tokens=99, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(DataError, match="not empty and holds no prepare"):
        prepare([src], "byte", tmp_path / "other", progress=False)


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dilocod", "data", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_cli_tokenizer_and_prepare(tmp_path: Path) -> None:
    make_sources(tmp_path)
    made = run_cli(tmp_path, "tokenizer", "tree", "docs.jsonl", "--vocab-size", "300", "--out", "tok.json")
    assert made.returncode == 0, made.stderr
    assert load_tokenizer(tmp_path / "tok.json").get_vocab_size() == 300
    done = run_cli(
        tmp_path,
        "prepare",
        "tree",
        "rows.parquet",
        "--tokenizer",
        "tok.json",
        "--out",
        "ds",
        "--shard-tokens",
        "100",
        "--eval-fraction",
        "0.1",
    )
    assert done.returncode == 0, done.stderr
    index = load_index(tmp_path / "ds")
    assert done.stdout.startswith(f"dataset {index.hash}: train {index.train.tokens} tokens")
    assert "tokens/s" in done.stdout and "prepare" in done.stderr  # the bar


def test_cli_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text("[1]\n", encoding="utf-8")
    bad = run_cli(tmp_path, "prepare", "d.jsonl", "--tokenizer", "byte", "--out", "ds", "--no-progress")
    assert bad.returncode == 2
    assert bad.stderr == "dilocod: error: d.jsonl:1: expected a JSON object, got list\n"
    bad = run_cli(tmp_path, "tokenizer", "missing", "--vocab-size", "300", "--out", "t.json")
    assert (bad.returncode, bad.stderr) == (2, "dilocod: error: missing: no such file or directory\n")
    (tmp_path / "empty").mkdir()  # nothing to learn merges from: no tokenizer of the bare bytes is written
    bad = run_cli(tmp_path, "tokenizer", "empty", "--vocab-size", "300", "--out", "t.json")
    assert (bad.returncode, bad.stderr) == (
        2,
        "dilocod: error: no text found in empty to train a tokenizer on (only empty or binary files, or none)\n",
    )
    assert not (tmp_path / "t.json").exists()


def test_documents_given_by_a_function(tmp_path: Path) -> None:
    docs = [Document(f"doc{i}", text(i)) for i in range(30)]
    index = prepare(
        [], "byte", tmp_path / "ds", eval_fraction=0.2, progress=False, documents=lambda: iter(docs)
    )
    expected = [d.text.encode() for d in docs if not is_eval(d.key, 0.2)]
    stream = TokenStream(tmp_path / "ds", index, "train")
    assert stream.read(0, len(stream)).astype(np.uint8).tobytes() == b"\0".join(expected) + b"\0"
    assert index.train.documents + index.eval.documents == 30
