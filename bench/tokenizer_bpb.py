"""The tiny model on the built-in corpus: the byte tokenizer against a BPE, in bits per byte of the same text.

    .venv/bin/python bench/tokenizer_bpb.py [--vocab 4096] [--token-marks 300000,1000000,2000000] [--threads 1]
                                            [--chunk 5] [--work /tmp/bench-bpe] [--keep]

The byte dataset is the builtin corpus (`source_dataset(DataConfig())`). A byte-level BPE of `--vocab` tokens
is trained (`train_bpe`) on the train documents of the same corpus (the documents prepare assigns to train:
eval_score >= eval_fraction), and the same documents are prepared with it (`prepare(documents=
builtin_documents)`, same eval_fraction), so both datasets hold the same eval documents. Two `InnerTrainer`s,
same seed, batch 16 × seq 128, configs/tiny.toml's optimizer (Muon) and lr schedule (2e-3, 20 warm-up steps,
cosine over 5000 steps); the BPE model's vocabulary is `padded_vocab(vocab)`. Both sample windows from the whole
train stream (`num_shards = 1`; with a run's 16 the BPE model would repeat its 1/16 five times by 1M tokens).

They train in alternating chunks of `--chunk` steps, always advancing the one that has used less CPU time,
so at any moment both have had about the same compute (on a shared machine, CPU seconds of a one-thread
trainer are its compute; wall seconds depend on the other jobs, and are reported too). Whenever one model
reaches a token mark, both are evaluated: the one at the mark gives the equal-tokens row, the pair gives an
equal-time row.

Eval: `trainer.evaluate()` over the whole eval split cut into consecutive windows of seq_len (batches of
16; the tail that does not fill a batch is left out), as bits per byte of the text those windows predict:
mean loss / ln 2 × (targets / their UTF-8 bytes), the EOS tokens counting no bytes. That is
`corpus.bits_per_byte` restricted to the text actually evaluated (printed too), so both tokenizers are
scored on nearly the same text (the BPE's windows cover ~3.5 × more text each; the eval text left out is
printed). Note that a BPE window of 128 tokens is also ~3.5 × more context.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from dilocod.data.corpus import Corpus
    from dilocod.trainer.inner import InnerTrainer

BATCH, SEQ = 16, 128


def token_bytes(tokenizer_json: Path | None, vocab: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens such as EOS)."""
    if tokenizer_json is None:  # the byte tokenizer: id b is byte b; id 0 (NUL) is also EOS
        out = np.ones(vocab, dtype=np.int64)
        out[0] = 0
        return out
    from dilocod.data.tokenizer import _byte_symbols

    symbol_byte = {s: 1 for s in _byte_symbols()}
    obj = json.loads(tokenizer_json.read_text())
    out = np.zeros(vocab, dtype=np.int64)
    for piece, tid in obj["model"]["vocab"].items():
        out[tid] = sum(symbol_byte[c] for c in piece)  # each symbol is one byte
    for added in obj.get("added_tokens", []):
        out[added["id"]] = 0
    return out


def tiled_eval(corpus: Corpus, per_token_bytes: np.ndarray) -> tuple[list, int, int, int]:
    """The eval split cut in consecutive windows, in full batches; (batches, targets, their bytes, split tokens)."""
    stream = corpus.eval
    n = len(stream)
    tokens = torch.from_numpy(stream.read(0, n))  # type: ignore[union-attr]
    windows = (n - 1) // SEQ
    windows -= windows % BATCH
    batches = []
    target_bytes = 0
    for b in range(windows // BATCH):
        xs, ys = [], []
        for w in range(b * BATCH, (b + 1) * BATCH):
            chunk = tokens[w * SEQ : w * SEQ + SEQ + 1]
            xs.append(chunk[:-1])
            ys.append(chunk[1:])
            target_bytes += int(per_token_bytes[chunk[1:].numpy()].sum())
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches, windows * SEQ, target_bytes, n


@dataclass
class Run:
    name: str
    trainer: InnerTrainer
    corpus: Corpus
    bytes_per_target: float  # eval text bytes per predicted token, of the windows evaluated
    cpu: float = 0.0
    wall: float = 0.0
    marks: list[int] = field(default_factory=list)  # token marks still ahead
    evals: list[tuple[int, float, float, float, float]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.trainer.step * BATCH * SEQ

    def steps_to_next_mark(self) -> int:
        return -(-(self.marks[0] - self.tokens) // (BATCH * SEQ)) if self.marks else 0

    def train(self, steps: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.trainer.train_steps(steps)
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu

    def evaluate(self) -> float:
        loss = self.trainer.evaluate()
        bpb = loss / math.log(2) / self.bytes_per_target
        self.evals.append((self.tokens, self.cpu, self.wall, bpb, self.corpus.bits_per_byte(loss)))
        print(
            f"    {self.name}: {self.tokens:,} tokens, {self.cpu:.1f} s CPU, {self.wall:.1f} s wall: "
            f"{bpb:.4f} bits/byte (corpus.bits_per_byte {self.corpus.bits_per_byte(loss):.4f}), "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        return bpb


def prepare_bpe(work: Path, vocab: int) -> tuple[Path, Path]:
    """Train the BPE on the builtin corpus's train documents and prepare the corpus with it (once)."""
    from dilocod.data.builtin import builtin_documents
    from dilocod.data.prepare import eval_score, prepare
    from dilocod.data.settings import DataConfig
    from dilocod.data.tokenizer import train_bpe

    cfg = DataConfig()
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = work / f"bpe-{vocab}.json"
    if not tokenizer.exists():
        train_text = work / "train.jsonl"
        with train_text.open("w") as f:
            for doc in builtin_documents(cfg.max_bytes):
                if eval_score(doc.key) >= cfg.eval_fraction:
                    f.write(json.dumps({"text": doc.text}) + "\n")
        wall, cpu = time.perf_counter(), time.process_time()
        train_bpe([train_text], vocab, tokenizer)
        print(
            f"trained the BPE in {time.perf_counter() - wall:.1f} s ({time.process_time() - cpu:.1f} s CPU)"
        )
    out = work / f"bpe-{vocab}"
    wall, cpu = time.perf_counter(), time.process_time()
    prepare(
        [], tokenizer, out, eval_fraction=cfg.eval_fraction, progress=False,
        documents=lambda: builtin_documents(cfg.max_bytes),
    )  # fmt: skip
    print(
        f"prepared the BPE dataset in {time.perf_counter() - wall:.1f} s ({time.process_time() - cpu:.1f} s CPU)"
    )
    return tokenizer, out


def make_run(
    name: str, corpus: Corpus, vocab: int, per_token_bytes: np.ndarray, threads: int, marks: list[int]
) -> Run:
    from dilocod.data.tokenizer import padded_vocab
    from dilocod.trainer import DataConfig, InnerTrainer, ModelConfig, TrainerConfig

    cfg = TrainerConfig(
        batch_size=BATCH, seq_len=SEQ, lr=2e-3, warmup_steps=20, total_steps=5000, eval_batches=1,
        threads=threads, optimizer="muon",
    )  # fmt: skip
    model = ModelConfig("tiny", vocab_size=0 if vocab == 256 else padded_vocab(vocab))
    # The whole train stream: a run's 1/16 of this small corpus is ~200k BPE tokens, which 1M tokens of
    # training would go over 5 times (and the byte model's 690k fewer times): an unequal overfit.
    data = DataConfig(num_shards=1)
    trainer = InnerTrainer(model, data, cfg, seed=0, peer_key="bench", corpus=corpus)
    batches, targets, target_bytes, split_tokens = tiled_eval(corpus, per_token_bytes)
    trainer.eval_set = batches
    print(
        f"{name}: vocab {vocab} (model {trainer.model.shape.vocab_size}), {len(corpus.train):,} train tokens; "
        f"eval {len(batches)} batches = {targets:,} of the split's {split_tokens:,} tokens, {target_bytes:,} bytes "
        f"of text ({target_bytes / targets:.3f} bytes/token; corpus: {1 / corpus.eval_tokens_per_byte:.3f})"
    )
    return Run(name, trainer, corpus, target_bytes / targets, marks=list(marks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--token-marks", default="300000,1000000,2000000")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=5, help="inner steps per turn")
    parser.add_argument("--work", default="/tmp/bench-bpe")
    parser.add_argument("--keep", action="store_true", help="keep the BPE and its dataset under --work")
    args = parser.parse_args()
    from dilocod.data.localcopy import open_corpus, source_dataset
    from dilocod.data.settings import DataConfig

    started = time.perf_counter()
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; torch {torch.__version__}"
    )
    marks = [int(m) for m in args.token_marks.split(",")]
    work = Path(args.work)
    try:
        byte_dir = source_dataset(DataConfig())
        tokenizer, bpe_dir = prepare_bpe(work, args.vocab)
        byte_corpus = open_corpus(DataConfig(path=str(byte_dir)))
        bpe_corpus = open_corpus(DataConfig(path=str(bpe_dir)))
        vocab = json.loads((bpe_dir / "index.json").read_text())["vocab_size"]
        runs = [
            make_run("byte", byte_corpus, 256, token_bytes(None, 256), args.threads, marks),
            make_run(
                f"bpe-{args.vocab}", bpe_corpus, vocab, token_bytes(tokenizer, vocab), args.threads, marks
            ),
        ]
        torch.set_num_threads(args.threads)
        equal_time: list[tuple[tuple[int, float, float, float, float], ...]] = []
        whens: list[str] = []
        while any(r.marks for r in runs):
            run = min(runs, key=lambda r: r.cpu)  # the one behind in compute; both go on until all marks
            run.train(min(args.chunk, run.steps_to_next_mark()) if run.marks else args.chunk)
            if run.marks and run.tokens >= run.marks[0]:
                whens.append(f"{run.name} at {run.marks.pop(0):,}")
                print(f"  {whens[-1]} tokens", flush=True)
                for r in runs:
                    r.evaluate()
                equal_time.append(tuple(r.evals[-1] for r in runs))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{time.perf_counter() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    a, b = runs
    print("Equal tokens (batch 16 × 128, the same steps and lr schedule):\n")
    print(
        f"| tokens | {a.name} bits/byte | {b.name} bits/byte | ≈ text seen: {a.name} / {b.name} | CPU s: {a.name} / {b.name} |"
    )
    print("|---|---|---|---|---|")
    for mark in marks:
        ea = next(e for e in a.evals if e[0] >= mark)
        eb = next(e for e in b.evals if e[0] >= mark)
        print(
            f"| {ea[0]:,} | {ea[3]:.4f} | {eb[3]:.4f} | {ea[0] * a.bytes_per_target / 1e6:.2f} MB / "
            f"{eb[0] * b.bytes_per_target / 1e6:.2f} MB | {ea[1]:.0f} / {eb[1]:.0f} |"
        )
    print(
        "\nEqual time (both evaluated whenever one reaches a token mark; training CPU seconds, one at a time):\n"
    )
    print(f"| when | CPU s {a.name} / {b.name} | wall s {a.name} / {b.name} | tokens {a.name} / {b.name} "
          f"| {a.name} bits/byte | {b.name} bits/byte |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for when, (ea, eb) in zip(whens, equal_time, strict=True):
        print(
            f"| {when} | {ea[1]:.0f} / {eb[1]:.0f} | {ea[2]:.0f} / {eb[2]:.0f} "
            f"| {ea[0]:,} / {eb[0]:,} | {ea[3]:.4f} | {eb[3]:.4f} |"
        )


if __name__ == "__main__":
    main()
