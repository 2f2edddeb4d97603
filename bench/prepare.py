"""Throughput of `dilocod data prepare` vs a bare loop of the tokenizer's batch encoder on the same documents.

    .venv/bin/python bench/prepare.py [--mb 50] [--corpus FILE.jsonl] [--tokenizer tokenizer.json]
                                      [--vocab-size 4096] [--rounds 2] [--batch 1024]

Without --corpus, the Python stdlib's .py files (site-packages excluded) become a JSONL corpus of --mb MB (a
document per file, repeated if the stdlib is smaller). Without --tokenizer, a byte-level BPE of --vocab-size
tokens is trained on its first 8 MB. Then, alternating --rounds times (this machine is noisy), side by side:

- bare: `tokenizer.encode_batch` over the documents already in memory, in batches of --batch, and the same
  with `encode_batch_fast` (what prepare calls: the same ids, no offsets); every Encoding's ids are touched;
- prepare: the whole `prepare()` from the JSONL file into an empty directory (reading, hashing, splitting,
  writing and hashing shards included), no progress bar.

Both run with the library's default thread pool (every core). Prints tokens/s, MB/s of text, and the ratio of
prepare to the bare loop (the goal is >= 0.9), by wall time and by CPU time (tokens per CPU second of all
the process's threads: what a shared, busy machine still measures fairly).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.data.prepare import prepare  # noqa: E402
from dilocod.data.sources import iter_documents  # noqa: E402
from dilocod.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402


def stdlib_corpus(path: Path, megabytes: float) -> None:
    """A JSONL of the stdlib's .py files (a document each), repeated until ``megabytes`` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    budget = int(megabytes * 1e6)
    with path.open("w", encoding="utf-8") as out:
        while budget > 0:
            for file in files:
                try:
                    text = file.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                out.write(json.dumps({"text": text}) + "\n")
                budget -= len(text.encode("utf-8"))
                if budget <= 0:
                    break


def first_megabytes(corpus: Path, out: Path, megabytes: float) -> Path:
    with corpus.open("rb") as src, out.open("wb") as dst:
        budget = int(megabytes * 1e6)
        for line in src:
            dst.write(line)
            budget -= len(line)
            if budget <= 0:
                break
    return out


def bare(encode: Callable[[list[str]], list], texts: list[str], batch: int) -> int:  # type: ignore[type-arg]
    tokens = 0
    for i in range(0, len(texts), batch):
        for enc in encode(texts[i : i + batch]):
            tokens += len(enc.ids) + 1  # + EOS, as prepare counts
    return tokens


def timed(fn: Callable[[], int]) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds of every thread of this process)."""
    start, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB of text (stdlib corpus)")
    ap.add_argument("--corpus", type=Path, help="a JSONL corpus (field 'text') instead of the stdlib")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json instead of training one")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024, help="documents per encode_batch call")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dilocod-bench-prepare-"))
    try:
        corpus = args.corpus
        if corpus is None:
            corpus = work / "corpus.jsonl"
            stdlib_corpus(corpus, args.mb)
        tok_path = args.tokenizer
        if tok_path is None:
            start = time.perf_counter()
            sample = first_megabytes(corpus, work / "sample.jsonl", 8)
            tok_path = train_bpe([sample], args.vocab_size, work / "tokenizer.json")
            print(f"trained a BPE of {args.vocab_size} tokens on 8 MB in {time.perf_counter() - start:.1f} s")
        tok = load_tokenizer(tok_path)
        texts = [d.text for d in iter_documents([corpus]) if d.text]  # prepare skips empty documents
        text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        print(f"corpus: {corpus} ({len(texts)} documents, {text_mb:.1f} MB of text)")

        def run_prepare() -> int:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            index = prepare(
                [corpus], tok_path, out, eval_fraction=0.01, batch_documents=args.batch, progress=False
            )
            return index.train.tokens + index.eval.tokens

        kinds: dict[str, Callable[[], int]] = {
            "bare encode_batch": lambda: bare(
                lambda b: tok.encode_batch(b, add_special_tokens=False), texts, args.batch
            ),
            "bare encode_batch_fast": lambda: bare(
                lambda b: tok.encode_batch_fast(b, add_special_tokens=False), texts, args.batch
            ),
            "prepare": run_prepare,
        }
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        cpu_rates: dict[str, list[float]] = {k: [] for k in kinds}
        counts: dict[str, int] = {}
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
        for r in range(args.rounds):
            for name, fn in kinds.items():
                tokens, seconds, cpu = timed(fn)
                counts[name] = tokens
                rates[name].append(tokens / seconds)
                cpu_rates[name].append(tokens / cpu)
                print(
                    f"round {r + 1} {name:24s} {tokens / seconds / 1e6:6.2f} M tokens/s "
                    f"{text_mb / seconds:6.2f} MB/s  ({seconds:.1f} s wall, {cpu:.1f} s CPU)"
                )
        assert len(set(counts.values())) == 1, f"token counts differ: {counts}"
        tokens = counts["prepare"]
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        print(f"\n{tokens} tokens ({tokens / text_mb / 1e6:.3f} per byte); medians:")
        med = {k: statistics.median(v) for k, v in rates.items()}
        cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
        for name, rate in med.items():
            print(
                f"  {name:24s} {rate / 1e6:6.2f} M tokens/s  {rate / tokens * text_mb:6.2f} MB/s   "
                f"per CPU second: {cpu_med[name] / 1e6:6.2f} M tokens, {cpu_med[name] / tokens * text_mb:6.2f} MB"
            )
        for base in ("bare encode_batch", "bare encode_batch_fast"):
            print(
                f"  prepare / {base}: {med['prepare'] / med[base]:.2f} (wall), "
                f"{cpu_med['prepare'] / cpu_med[base]:.2f} (per CPU second)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
