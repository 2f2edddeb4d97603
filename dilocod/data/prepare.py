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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dilocod.data.errors import DataError
from dilocod.data.preppass import STATE_VERSION, BatchEncoder, EncodedSplit, PreparePass, batches, eval_score
from dilocod.data.prepsplit import PrepareSettings
from dilocod.data.prepstate import clean, drop_remainders, finished, save_pass, save_state, start_state
from dilocod.data.shards import (
    INDEX_FILE,
    SPLITS,
    TOKENIZER_FILE,
    DatasetIndex,
    index_bytes,
    index_object,
    parse_index,
    shard_dtype,
)
from dilocod.data.sources import Document, check_sources, iter_documents
from dilocod.data.tokenizer import eos_id, load_tokenizer, tokenizer_json
from dilocod.files import atomic_write

__all__ = ["eval_score", "prepare"]


@dataclass
class _Job:
    cfg: PrepareSettings
    tok: Tokenizer
    documents: Callable[[], Iterable[Document]]  # a fresh iteration over every document, per pass
    batch_documents: int
    progress: bool

    def run_pass(self, p: PreparePass) -> None:
        encoder = BatchEncoder(self.tok, self.cfg)
        docs = iter(self.documents())
        bar = _Progress(self.progress)
        with bar, ThreadPoolExecutor(1, thread_name_prefix="dilocod-tokenize") as pool:
            # One batch tokenizes (the library releases the GIL and uses every core) while this thread reads
            # and assigns the next one.
            waiting: tuple[int, Future[dict[str, EncodedSplit]]] | None = None
            for end, batch in batches(docs, p.consumed, self.batch_documents):
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

    def _consume(
        self, p: PreparePass, end: int, future: Future[dict[str, EncodedSplit]], bar: _Progress
    ) -> None:
        written = 0
        for name, part in future.result().items():
            written += p.writers[name].add(part.tokens, part.documents, part.text_bytes)
            bar.update(part.tokens.size, part.text_bytes)
        p.consumed = end
        if written:
            save_pass(self.cfg.out, p)


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
    cfg = PrepareSettings(
        out=Path(out),
        dtype=shard_dtype(vocab_size),
        eos=eos_id(tok),
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
        eval_fraction=eval_fraction,
        tokenizer_raw=raw,
        args_hash=_args_hash(sources, raw, text_field, eval_fraction, shard_tokens),
    )
    state = start_state(cfg)
    if state is not None and (index := finished(cfg, state)) is not None:
        print(f"{cfg.out}: up to date (index {index.hash})", file=sys.stderr)
        return index
    job = _Job(cfg, tok, documents, batch_documents, progress)
    return _run(job, state)


def _run(job: _Job, state: dict[str, Any] | None) -> DatasetIndex:
    cfg = job.cfg
    cfg.out.mkdir(parents=True, exist_ok=True)
    unfinished = state is not None and not state.get("done")
    p = PreparePass(cfg)
    if not (unfinished and state is not None and p.restore(state)):
        # Nothing to continue (or its files changed since): start afresh, keeping a decided override.
        clean(cfg.out)
        p = PreparePass(cfg, override=state.get("override") if unfinished and state is not None else None)
        save_pass(cfg.out, p)  # from here on the directory is recognisably this prepare's
    job.run_pass(p)
    override = p.needed_override()
    if override is not None:
        # Rare (a handful of documents): a split came out empty; redo the pass with one document moved.
        clean(cfg.out)
        p = PreparePass(cfg, override=override)
        save_pass(cfg.out, p)
        job.run_pass(p)
        p.needed_override()  # raises if a split is still empty
    return _write_index(cfg, p)


def _write_index(cfg: PrepareSettings, p: PreparePass) -> DatasetIndex:
    splits = {name: w.finish() for name, w in p.writers.items()}
    atomic_write(cfg.out / TOKENIZER_FILE, [cfg.tokenizer_raw])
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
    atomic_write(cfg.out / INDEX_FILE, [raw])  # last: its presence means the dataset is complete
    state = {"version": STATE_VERSION, "args": cfg.args_hash, "done": True, "index": index.hash}
    save_state(cfg.out, state)
    drop_remainders(cfg.out)
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
