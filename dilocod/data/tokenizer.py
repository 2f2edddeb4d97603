"""Tokenizers of a prepared dataset: the built-in byte tokenizer, loading a tokenizer.json, training a BPE.

Every tokenizer is a Hugging Face ``tokenizers.Tokenizer``; the dataset stores its exact JSON bytes so that
peers can check (by sha256) that they tokenize alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dilocod.data.errors import DataError
from dilocod.files import atomic_write

BYTE = "byte"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BPE_EOS = "<|endoftext|>"
VOCAB_MULTIPLE = 64


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits), by byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + extra
            extra += 1
    return [chr(symbols[b]) for b in range(256)]


def _byte_tokenizer_dict() -> dict[str, object]:
    # Written out here rather than taken from Tokenizer.to_str(), so that the bytes (and so every dataset's
    # tokenizer hash) do not change with the tokenizers library's version.
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": {**byte_level, "add_prefix_space": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: b for b, symbol in enumerate(_byte_symbols())},
            "merges": [],
        },
    }


def canonical_json(obj: object) -> bytes:
    """Sorted keys, no spaces, ASCII only, a final newline: the same bytes for the same object everywhere."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


@functools.cache
def _byte_json() -> bytes:
    return canonical_json(_byte_tokenizer_dict())


def byte_tokenizer() -> Tokenizer:
    """The byte tokenizer: the id of byte b is b (256 ids, no merges); decoding gives back the exact text."""
    return Tokenizer.from_str(_byte_json().decode("ascii"))


def _is_byte(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec == BYTE


def tokenizer_json(spec: str | Path) -> bytes:
    """The exact bytes a dataset stores as its tokenizer.json for ``spec`` ("byte" or a file)."""
    if _is_byte(spec):
        return _byte_json()
    path = Path(spec)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such tokenizer file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read the tokenizer ({e.strerror or e})") from None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"`` or a path to a tokenizer.json; DataError (one line) when it is missing or does not load."""
    if _is_byte(spec):
        return byte_tokenizer()
    raw = tokenizer_json(spec)
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the library raises plain Exception for a bad file; UTF-8 errors too
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{spec}: not a loadable tokenizer.json ({detail})") from None


def is_byte_tokenizer(tok: Tokenizer) -> bool:
    """Whether ``tok`` is the byte tokenizer (so bytes can stand for ids without calling the library)."""
    if tok.get_vocab_size(with_added_tokens=True) != 256:
        return False
    return json.loads(tok.to_str())["model"] == _byte_tokenizer_dict()["model"]


def eos_id(tok: Tokenizer) -> int:
    """The end-of-document id: 0 (NUL) for the byte tokenizer, else the first known EOS special token."""
    if is_byte_tokenizer(tok):
        return 0
    for token in EOS_CANDIDATES:
        found = tok.token_to_id(token)
        if found is not None:
            return int(found)
    raise DataError(f"the tokenizer has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)})")


def padded_vocab(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of 64 (embedding tables of that width run faster)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def train_bpe(sources: Sequence[Path], vocab_size: int, out: Path, *, text_field: str = "text") -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included) on the sources; write
    it to ``out`` (atomically) and return ``out``. No network; the same sources give the same file."""
    from dilocod.data.sources import iter_documents  # sources does not need the tokenizer side

    minimum = 256 + 1
    if vocab_size < minimum:
        raise DataError(
            f"--vocab-size must be at least {minimum} (256 bytes + <|endoftext|>), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    seen = [0]  # characters of text read

    def texts() -> Iterator[str]:
        for doc in iter_documents(sources, text_field=text_field):
            seen[0] += len(doc.text.strip())
            yield doc.text

    tok.train_from_iterator(texts(), trainer=trainer)
    if not seen[0]:  # a tokenizer of the bare bytes would train nothing and fit no data
        names = ", ".join(str(s) for s in sources)
        raise DataError(
            f"no text found in {names} to train a tokenizer on (only empty or binary files, or none)"
        )
    out = Path(out)
    atomic_write(out, [tok.to_str(pretty=True).encode("utf-8")])
    return out
