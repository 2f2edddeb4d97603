"""`dilocod data prepare`'s pass over the documents: which split each document goes to (by the hash of
its key), batches of them, and the library's batch encoder turning a batch into each split's tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dilocod.data.errors import DataError
from dilocod.data.prepsplit import PrepareSettings, SplitWriter
from dilocod.data.shards import SPLITS
from dilocod.data.sources import Document
from dilocod.data.tokenizer import is_byte_tokenizer

STATE_VERSION = 1  # of the state file (`prepstate.py`), whose contents a pass makes
BATCH_TEXT_BYTES = 32 << 20  # a batch also ends here: 1024 documents of a MB each would be a GB at once


def eval_score(key: str) -> float:
    """The spec's value in [0, 1) for a document key; below eval_fraction means eval."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class EncodedSplit:
    """A batch's share of one split."""

    tokens: np.ndarray  # each document's ids, then EOS
    documents: int
    text_bytes: int


class BatchEncoder:
    """Texts -> one split's token stream (each document's ids, then EOS)."""

    def __init__(self, tok: Tokenizer, cfg: PrepareSettings) -> None:
        self.tok = tok
        self.cfg = cfg
        # The byte tokenizer's ids are the UTF-8 bytes: numpy does in one copy what the library does per token.
        self.byte = is_byte_tokenizer(tok)
        self.eos_bytes = bytes([cfg.eos]) if self.byte else b""

    def encode(self, groups: dict[str, list[str]]) -> dict[str, EncodedSplit]:
        """Per split: the tokens of its texts, in order."""
        if self.byte:
            return {name: self._bytes(texts) for name, texts in groups.items()}
        names = [name for name, texts in groups.items() for _ in texts]
        texts = [text for name in groups for text in groups[name]]
        # encode_batch_fast: the ids of encode_batch without computing offsets, which prepare has no use for
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        flat: dict[str, list[int]] = {name: [] for name in groups}
        for name, enc in zip(names, encodings):
            ids = flat[name]
            ids += enc.ids
            ids.append(self.cfg.eos)
        return {
            name: EncodedSplit(
                np.array(flat[name], dtype=self.cfg.dtype),
                len(texts),
                sum(len(t.encode("utf-8")) for t in texts),
            )
            for name, texts in groups.items()
        }

    def _bytes(self, texts: list[str]) -> EncodedSplit:
        if not texts:
            return EncodedSplit(np.empty(0, dtype=self.cfg.dtype), 0, 0)
        data = [t.encode("utf-8") for t in texts]
        joined = self.eos_bytes.join(data) + self.eos_bytes
        return EncodedSplit(
            np.frombuffer(joined, dtype=np.uint8).astype(self.cfg.dtype), len(data), len(joined) - len(data)
        )


@dataclass
class PreparePass:
    """A pass over every document; ``override`` moves one document (or splits the only one) so that both
    splits are non-empty, as the dataset spec requires. Documents are counted by ordinal (every one the
    sources yield, empty ones too), which is what a resumed pass skips."""

    cfg: PrepareSettings
    override: dict[str, Any] | None = None
    consumed: int = 0
    nonempty: int = 0
    lowest: tuple[int, float] | None = None  # (ordinal, score) of the first document with the lowest score
    highest: tuple[int, float] | None = None  # ... and with the highest
    writers: dict[str, SplitWriter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.writers = {name: SplitWriter(name, self.cfg) for name in SPLITS}

    def assign(self, ordinal: int, doc: Document) -> list[tuple[str, str]]:
        """(split, text) pieces of one document: usually one, two for a split single document."""
        if not doc.text:
            return []
        self.nonempty += 1
        score = eval_score(doc.key)
        if self.lowest is None or score < self.lowest[1]:
            self.lowest = (ordinal, score)
        if self.highest is None or score > self.highest[1]:
            self.highest = (ordinal, score)
        split = "eval" if score < self.cfg.eval_fraction else "train"
        override = self.override
        if override is not None and override["ordinal"] == ordinal:
            if override["kind"] == "single":
                return _split_text(doc, self.cfg.eval_fraction)
            split = override["kind"]  # "train" or "eval"
        return [(split, doc.text)]

    def state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "args": self.cfg.args_hash,
            "done": False,
            "override": self.override,
            "consumed": self.consumed,
            "nonempty": self.nonempty,
            "lowest": self.lowest,
            "highest": self.highest,
            "splits": {name: w.state(self.consumed) for name, w in self.writers.items()},
        }

    def restore(self, saved: dict[str, Any]) -> bool:
        self.override = saved["override"]
        self.consumed, self.nonempty = saved["consumed"], saved["nonempty"]
        self.lowest = tuple(saved["lowest"]) if saved["lowest"] else None  # type: ignore[assignment]
        self.highest = tuple(saved["highest"]) if saved["highest"] else None  # type: ignore[assignment]
        return all(w.restore(saved["splits"][name]) for name, w in self.writers.items())

    def needed_override(self) -> dict[str, Any] | None:
        """None when both splits have documents, else what the next pass must do differently."""
        if self.writers["train"].documents and self.writers["eval"].documents:
            return None
        if self.nonempty == 0:
            raise DataError("no text found: every document of the sources is empty")
        if self.override is not None:
            raise RuntimeError(f"prepare: a split is still empty with override {self.override}")
        assert self.lowest is not None and self.highest is not None
        if self.nonempty == 1:
            return {"kind": "single", "ordinal": self.lowest[0]}
        if not self.writers["eval"].documents:
            return {"kind": "eval", "ordinal": self.lowest[0]}
        return {"kind": "train", "ordinal": self.highest[0]}


def _split_text(doc: Document, eval_fraction: float) -> list[tuple[str, str]]:
    """The only document: its start trains, its end (about eval_fraction of it) evaluates."""
    n = len(doc.text)
    if n < 2:
        raise DataError(f"{doc.key}: the only document has one character; train and eval need two")
    n_eval = min(max(1, round(n * eval_fraction)), n - 1)
    return [("train", doc.text[:-n_eval]), ("eval", doc.text[-n_eval:])]


def batches(docs: Iterator[Document], start: int, size: int) -> Iterator[tuple[int, list[Document]]]:
    """(ordinal after the batch, documents) from document ``start`` on, at most ``size`` documents and
    about BATCH_TEXT_BYTES characters each."""
    batch: list[Document] = []
    chars = 0
    ordinal = 0
    for ordinal, doc in enumerate(docs, start=1):
        if ordinal <= start:
            continue  # done before the interruption
        batch.append(doc)
        chars += len(doc.text)
        if len(batch) >= size or chars >= BATCH_TEXT_BYTES:
            yield ordinal, batch
            batch, chars = [], 0
    if ordinal < start:
        raise DataError(f"the sources now hold {ordinal} documents, fewer than the {start} already prepared")
    if batch:
        yield ordinal, batch
