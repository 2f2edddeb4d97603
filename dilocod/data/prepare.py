"""`dilocod data prepare`: sources -> a tokenized, sharded, hashed dataset directory (see the dataset spec).

Streaming: documents are read, tokenized in batches by the library's batch encoder (all cores) and cut into
fixed-size shards as they come, so memory holds about a batch and one shard per split, whatever the corpus.
Resumable: after every batch that completed a shard, a small state file records how many documents are done,
the shards written and the not yet full remainder of each split; a rerun with the same arguments continues
from there and writes the same bytes an uninterrupted run would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dilocod.data.errors import DataError
from dilocod.data.shards import (
    INDEX_FILE,
    SPLITS,
    TOKENIZER_FILE,
    DatasetIndex,
    ShardInfo,
    SplitInfo,
    file_sha256,
    index_bytes,
    index_object,
    load_index,
    parse_index,
    shard_dtype,
    shard_name,
    write_file_atomically,
    write_shard,
)
from dilocod.data.sources import Document, check_sources, iter_documents
from dilocod.data.tokenizer import eos_id, is_byte_tokenizer, load_tokenizer, tokenizer_json

STATE_FILE = ".prepare-state.json"
REMAINDER_PREFIX = ".prepare-"
STATE_VERSION = 1
BATCH_TEXT_BYTES = 32 << 20  # a batch also ends here: 1024 documents of a MB each would be a GB at once


def eval_score(key: str) -> float:
    """The spec's value in [0, 1) for a document key; below eval_fraction means eval."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class _Config:
    out: Path
    dtype: str
    eos: int
    vocab_size: int
    shard_tokens: int
    eval_fraction: float
    tokenizer_raw: bytes
    args_hash: str


# ---------------------------------------------------------------- the token streams being cut into shards


@dataclass
class _SplitWriter:
    """One split's counts, its written shards and the tokens waiting for the next shard."""

    name: str
    cfg: _Config
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    pending: list[np.ndarray] = field(default_factory=list)
    pending_tokens: int = 0

    def add(self, tokens: np.ndarray, documents: int, text_bytes: int) -> int:
        """Append a batch's tokens; write every shard they complete. Returns how many were written."""
        self.documents += documents
        self.text_bytes += text_bytes
        self.tokens += tokens.size
        self.pending.append(tokens)
        self.pending_tokens += tokens.size
        if self.pending_tokens < self.cfg.shard_tokens:
            return 0
        joined = self.remainder()
        size = self.cfg.shard_tokens
        full = joined.size // size
        for i in range(full):
            self._write(joined[i * size : (i + 1) * size])
        rest = joined[full * size :].copy()  # a copy: the view would keep the whole batch alive
        self.pending, self.pending_tokens = [rest], rest.size
        return full

    def remainder(self) -> np.ndarray:
        if not self.pending:
            return np.empty(0, dtype=self.cfg.dtype)
        return self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)

    def _write(self, tokens: np.ndarray) -> None:
        path = self.cfg.out / shard_name(self.name, len(self.shards))
        self.shards.append(write_shard(path, tokens, self.cfg.dtype))

    def finish(self) -> SplitInfo:
        if self.pending_tokens:
            self._write(self.remainder())
            self.pending, self.pending_tokens = [], 0
        return SplitInfo(self.documents, self.tokens, self.text_bytes, tuple(self.shards))

    def state(self, generation: int) -> dict[str, Any]:
        """The counts for the state file, after writing the remainder to a file of its own: named by
        ``generation``, so that the previous state's remainder survives until the new state is saved."""
        rem = self.remainder()
        path = self.cfg.out / f"{REMAINDER_PREFIX}{self.name}-{generation}.rem"
        digest = write_file_atomically(path, [_le_bytes(rem, self.cfg.dtype)])
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "shards": [s.to_json() for s in self.shards],
            "remainder": {"file": path.name, "tokens": int(rem.size), "sha256": digest},
        }

    def restore(self, saved: dict[str, Any]) -> bool:
        """Take over a saved state; False when its files are not (any more) what it recorded."""
        shards = [ShardInfo(**s) for s in saved["shards"]]
        for info in shards:
            path = self.cfg.out / info.file
            if not path.is_file() or path.stat().st_size != info.bytes:
                return False
        rem_path = self.cfg.out / saved["remainder"]["file"]
        if not rem_path.is_file() or file_sha256(rem_path) != saved["remainder"]["sha256"]:
            return False
        rem = np.fromfile(rem_path, dtype=np.dtype(self.cfg.dtype).newbyteorder("<")).astype(self.cfg.dtype)
        self.documents, self.tokens, self.text_bytes = (
            saved["documents"],
            saved["tokens"],
            saved["text_bytes"],
        )
        self.shards = shards
        self.pending, self.pending_tokens = [rem], rem.size
        return True


def _le_bytes(tokens: np.ndarray, dtype: str) -> memoryview:
    return np.ascontiguousarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).data.cast("B")


# ---------------------------------------------------------------- tokenizing a batch


@dataclass(frozen=True)
class _Tokens:
    """A batch's share of one split."""

    tokens: np.ndarray  # each document's ids, then EOS
    documents: int
    text_bytes: int


class _Encoder:
    """Texts -> one split's token stream (each document's ids, then EOS)."""

    def __init__(self, tok: Tokenizer, cfg: _Config) -> None:
        self.tok = tok
        self.cfg = cfg
        # The byte tokenizer's ids are the UTF-8 bytes: numpy does in one copy what the library does per token.
        self.byte = is_byte_tokenizer(tok)
        self.eos_bytes = bytes([cfg.eos]) if self.byte else b""

    def encode(self, groups: dict[str, list[str]]) -> dict[str, _Tokens]:
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
            name: _Tokens(
                np.array(flat[name], dtype=self.cfg.dtype),
                len(texts),
                sum(len(t.encode("utf-8")) for t in texts),
            )
            for name, texts in groups.items()
        }

    def _bytes(self, texts: list[str]) -> _Tokens:
        if not texts:
            return _Tokens(np.empty(0, dtype=self.cfg.dtype), 0, 0)
        data = [t.encode("utf-8") for t in texts]
        joined = self.eos_bytes.join(data) + self.eos_bytes
        return _Tokens(
            np.frombuffer(joined, dtype=np.uint8).astype(self.cfg.dtype), len(data), len(joined) - len(data)
        )


# ---------------------------------------------------------------- one pass over the documents


@dataclass
class _Pass:
    """A pass over every document; ``override`` moves one document (or splits the only one) so that both
    splits are non-empty, as the dataset spec requires. Documents are counted by ordinal (every one the
    sources yield, empty ones too), which is what a resumed pass skips."""

    cfg: _Config
    override: dict[str, Any] | None = None
    consumed: int = 0
    nonempty: int = 0
    lowest: tuple[int, float] | None = None  # (ordinal, score) of the first document with the lowest score
    highest: tuple[int, float] | None = None  # ... and with the highest
    writers: dict[str, _SplitWriter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.writers = {name: _SplitWriter(name, self.cfg) for name in SPLITS}

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


def _batches(docs: Iterator[Document], start: int, size: int) -> Iterator[tuple[int, list[Document]]]:
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


# ---------------------------------------------------------------- the prepare


@dataclass
class _Job:
    cfg: _Config
    tok: Tokenizer
    documents: Callable[[], Iterable[Document]]  # a fresh iteration over every document, per pass
    batch_documents: int
    progress: bool

    def run_pass(self, p: _Pass) -> None:
        encoder = _Encoder(self.tok, self.cfg)
        docs = iter(self.documents())
        bar = _Progress(self.progress)
        with bar, ThreadPoolExecutor(1, thread_name_prefix="dilocod-tokenize") as pool:
            # One batch tokenizes (the library releases the GIL and uses every core) while this thread reads
            # and assigns the next one.
            waiting: tuple[int, Future[dict[str, _Tokens]]] | None = None
            for end, batch in _batches(docs, p.consumed, self.batch_documents):
                groups: dict[str, list[str]] = {name: [] for name in SPLITS}
                for ordinal, doc in enumerate(batch, start=end - len(batch)):
                    for split, text in p.assign(ordinal, doc):
                        groups[split].append(text)
                future = pool.submit(encoder.encode, groups)
                if waiting is not None:
                    self._consume(p, *waiting, bar)
                waiting = (end, future)
            if waiting is not None:
                self._consume(p, *waiting, bar)

    def _consume(self, p: _Pass, end: int, future: Future[dict[str, _Tokens]], bar: _Progress) -> None:
        written = 0
        for name, part in future.result().items():
            written += p.writers[name].add(part.tokens, part.documents, part.text_bytes)
            bar.update(part.tokens.size, part.text_bytes)
        p.consumed = end
        if written:
            _checkpoint(self.cfg.out, p)


def _save_state(out: Path, state: dict[str, Any]) -> None:
    write_file_atomically(out / STATE_FILE, [json.dumps(state, sort_keys=True).encode("utf-8")])


def _checkpoint(out: Path, p: _Pass) -> None:
    """Save the pass's state: remainders first, then the state file, then drop the remainders it replaced
    (a kill at any point leaves a state file whose remainder files are all there)."""
    state = p.state()
    _save_state(out, state)
    _drop_remainders(out, keep={split["remainder"]["file"] for split in state["splits"].values()})


def _drop_remainders(out: Path, keep: frozenset[str] | set[str] = frozenset()) -> None:
    for path in out.glob(f"{REMAINDER_PREFIX}*.rem"):
        if path.name not in keep:
            path.unlink()


def _read_state(out: Path) -> dict[str, Any] | None:
    path = out / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_bytes())
    except ValueError:
        return None
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else None


def _clean(out: Path) -> None:
    """Remove what a prepare writes (only that), for a fresh start in a directory of the same arguments."""
    for pattern in ("train-*.bin", "eval-*.bin", "*.tmp", ".prepare-*.rem", INDEX_FILE, TOKENIZER_FILE):
        for path in out.glob(pattern):
            path.unlink()


def _finished(cfg: _Config, state: dict[str, Any]) -> DatasetIndex | None:
    """The index of a finished prepare of these arguments whose files are all still in place."""
    if not state.get("done"):
        return None
    try:
        index = load_index(cfg.out)
    except DataError:
        return None
    if index.hash != state.get("index") or not (cfg.out / TOKENIZER_FILE).is_file():
        return None
    for info in index.files():
        path = cfg.out / info.file
        if not path.is_file() or path.stat().st_size != info.bytes:
            return None
    return index


def _args_hash(
    sources: Sequence[Path], tokenizer_raw: bytes, text_field: str, eval_fraction: float, shard_tokens: int
) -> str:
    args = {
        "sources": [str(Path(s).resolve()) for s in sources],
        "tokenizer_sha256": hashlib.sha256(tokenizer_raw).hexdigest(),
        "text_field": text_field,
        "eval_fraction": repr(eval_fraction),
        "shard_tokens": shard_tokens,
    }
    return hashlib.sha256(json.dumps(args, sort_keys=True).encode("utf-8")).hexdigest()


def _check_args(eval_fraction: float, shard_tokens: int, batch_documents: int) -> None:
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if batch_documents < 1:
        raise DataError(f"batch_documents must be >= 1, got {batch_documents}")


def _start_state(cfg: _Config) -> dict[str, Any] | None:
    """The saved state to continue from (None: start afresh); DataError for a directory that is not ours."""
    out = cfg.out
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return None
    state = _read_state(out)
    if state is None:
        raise DataError(f"{out}: not empty and holds no prepare; give an empty or new directory")
    if state.get("args") != cfg.args_hash:
        raise DataError(f"{out}: holds a prepare of other arguments; give an empty or new directory")
    return state


def prepare(
    sources: Sequence[Path],
    tokenizer: str | Path,
    out: Path,
    *,
    text_field: str = "text",
    eval_fraction: float = 0.01,
    shard_tokens: int = 2**24,
    batch_documents: int = 1024,
    progress: bool = True,
    documents: Callable[[], Iterable[Document]] | None = None,
) -> DatasetIndex:
    """Tokenize ``sources`` into the dataset directory ``out`` and return its index (see the module doc).

    ``documents``, when given, replaces the sources (give ``[]``): a function returning every document, in
    the same order each call (a pass may run twice). A resumed prepare trusts it to be the same as before.
    """
    _check_args(eval_fraction, shard_tokens, batch_documents)
    if documents is None:
        check_sources(sources)
        documents = functools.partial(iter_documents, sources, text_field=text_field)
    raw = tokenizer_json(tokenizer)
    tok = load_tokenizer(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    cfg = _Config(
        out=Path(out),
        dtype=shard_dtype(vocab_size),
        eos=eos_id(tok),
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
        eval_fraction=eval_fraction,
        tokenizer_raw=raw,
        args_hash=_args_hash(sources, raw, text_field, eval_fraction, shard_tokens),
    )
    state = _start_state(cfg)
    if state is not None and (index := _finished(cfg, state)) is not None:
        print(f"{cfg.out}: up to date (index {index.hash})", file=sys.stderr)
        return index
    job = _Job(cfg, tok, documents, batch_documents, progress)
    return _run(job, state)


def _run(job: _Job, state: dict[str, Any] | None) -> DatasetIndex:
    cfg = job.cfg
    cfg.out.mkdir(parents=True, exist_ok=True)
    unfinished = state is not None and not state.get("done")
    p = _Pass(cfg)
    if not (unfinished and state is not None and p.restore(state)):
        # Nothing to continue (or its files changed since): start afresh, keeping a decided override.
        _clean(cfg.out)
        p = _Pass(cfg, override=state.get("override") if unfinished and state is not None else None)
        _checkpoint(cfg.out, p)  # from here on the directory is recognisably this prepare's
    job.run_pass(p)
    override = p.needed_override()
    if override is not None:
        # Rare (a handful of documents): a split came out empty; redo the pass with one document moved.
        _clean(cfg.out)
        p = _Pass(cfg, override=override)
        _checkpoint(cfg.out, p)
        job.run_pass(p)
        p.needed_override()  # raises if a split is still empty
    return _write_index(cfg, p)


def _write_index(cfg: _Config, p: _Pass) -> DatasetIndex:
    splits = {name: w.finish() for name, w in p.writers.items()}
    write_file_atomically(cfg.out / TOKENIZER_FILE, [cfg.tokenizer_raw])
    obj = index_object(
        tokenizer_sha256=hashlib.sha256(cfg.tokenizer_raw).hexdigest(),
        vocab_size=cfg.vocab_size,
        eos_id=cfg.eos,
        shard_tokens=cfg.shard_tokens,
        train=splits["train"],
        eval=splits["eval"],
    )
    raw = index_bytes(obj)
    index = parse_index(raw, str(cfg.out / INDEX_FILE))  # what readers will check, checked before writing
    write_file_atomically(cfg.out / INDEX_FILE, [raw])  # last: its presence means the dataset is complete
    state = {"version": STATE_VERSION, "args": cfg.args_hash, "done": True, "index": index.hash}
    _save_state(cfg.out, state)
    _drop_remainders(cfg.out)
    return index


class _Progress:
    """A tqdm bar on stderr: tokens, tokens/s, and MB/s of text."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.text_bytes = 0
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(desc="prepare", unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True)

    def update(self, tokens: int, text_bytes: int) -> None:
        if self.bar is None:
            return
        self.text_bytes += text_bytes
        seconds = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.text_bytes / seconds / 1e6:.1f} MB/s text", refresh=False)
        self.bar.update(tokens)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
