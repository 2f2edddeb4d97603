"""A peer's data reader on a prepared dataset: its throughput against the trainer's, and its memory.

    .venv/bin/python bench/reader.py [--part all|throughput|memory] [--repeats 2] [--sizes-mb 100,2048]
                                     [--dir /tmp/bench-data] [--batches 200] [--keep]

Throughput (issue 25: the reader must never be what a peer waits for; goal: reader ≥ 100 × trainer):
`ShardSampler.batch()` over the memory-mapped builtin corpus (`source_dataset(DataConfig())`, this peer's
1/16 of the train stream, as a run samples it) at batch 16 × seq 128 and 8 × 1024, against
`InnerTrainer.train_steps` (threads = 2, configs/tiny.toml's optimizer and lr) of the tiny preset at 16 × 128
and of the small preset at 8 × 1024 (tiny's max_seq_len is 256) on the same corpus. Reader and trainer
alternate `--repeats` times (this machine is shared); the ratio is taken per pair, by wall time and by CPU
time (tokens per CPU second of all the process's threads: what a loaded machine still measures fairly).

Memory (goal: a peer's memory with a 2 GB dataset within 5 % of the one with a 100 MB dataset): datasets of
`--sizes-mb` MB of text are prepared with the byte tokenizer (uint16 shards: 2 bytes a token, twice the text
on disk) from generated documents (the standard library's .py files, repeated, each copy's documents marked
with a counter so that they differ), under `--dir` (deleted at the end unless `--keep`). Then, in a fresh
process per size: `load_corpus(DataConfig(path=DIR))` (the first open verifies every shard's sha256), a
`ShardSampler` with num_shards = 1 (windows from the whole stream), `--batches` batches of 16 × 128, and
the process's memory from /proc/self/status and /proc/self/smaps_rollup (peak RSS is VmHWM: getrusage's
ru_maxrss survives exec and would report the parent's peak). File-backed pages of the shards'
memory maps count in RSS (and in PSS/USS) while mapped, but they are clean page cache the kernel can drop at
any time; what would grow if the reader loaded the dataset is the anonymous memory (RssAnon), the fair figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dilocod.data.corpus import Corpus
    from dilocod.data.sources import Document

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1 << 20


# ---------------------------------------------------------------- throughput


def reader_rate(
    corpus: Corpus, batch: int, seq: int, seconds: float, num_shards: int = 16
) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of ShardSampler.batch() over ``corpus.train``, for about ``seconds``."""
    from dilocod.trainer.batches import ShardSampler

    sampler = ShardSampler(
        corpus.train, seed=0, peer_key="bench", num_shards=num_shards, batch_size=batch, seq_len=seq
    )
    for i in range(20):  # warm-up: the shard mapped, its pages in the page cache
        sampler.batch(10**6 + i)
    n = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while True:
        for _ in range(50):
            sampler.batch(n)
            n += 1
        if time.perf_counter() - wall >= seconds:
            break
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = n * batch * seq
    return tokens / wall, tokens / max(cpu, 1e-9)


def trainer_rate(corpus: Corpus, preset: str, batch: int, seq: int, steps: int) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of InnerTrainer.train_steps on ``corpus`` (2 threads)."""
    from dilocod.trainer import DataConfig, InnerTrainer, ModelConfig, TrainerConfig

    cfg = TrainerConfig(
        batch_size=batch,
        seq_len=seq,
        inner_steps=steps,
        lr=2e-3,
        warmup_steps=20,
        total_steps=5000,
        threads=2,
    )
    trainer = InnerTrainer(ModelConfig(preset), DataConfig(), cfg, seed=0, peer_key="bench", corpus=corpus)
    trainer.train_steps(1)  # warm-up
    cpu = time.process_time()
    stats = trainer.train_steps(steps)
    cpu = time.process_time() - cpu
    return stats.tokens / stats.seconds, stats.tokens / max(cpu, 1e-9)


def throughput(args: argparse.Namespace) -> list[str]:
    import torch

    from dilocod.data.localcopy import source_dataset
    from dilocod.trainer.batches import DataConfig, load_corpus

    started = time.perf_counter()
    directory = source_dataset(DataConfig())
    corpus = load_corpus(DataConfig())
    print(f"builtin corpus {directory} ({len(corpus.train):,} train tokens), ready in "
          f"{time.perf_counter() - started:.1f} s; torch {torch.__version__}")  # fmt: skip
    cases = [("tiny", 16, 128, args.tiny_steps), ("small", 8, 1024, args.small_steps)]
    rows = []
    for preset, batch, seq, steps in cases:
        reads, trains = [], []
        for r in range(args.repeats):
            read = reader_rate(corpus, batch, seq, args.reader_seconds)
            train = trainer_rate(corpus, preset, batch, seq, steps)
            reads.append(read)
            trains.append(train)
            print(f"  {preset} {batch}×{seq} repeat {r + 1}: reader {read[0]:,.0f} tok/s ({read[1]:,.0f}/CPU s), "
                  f"trainer {train[0]:,.0f} tok/s ({train[1]:,.0f}/CPU s), load {os.getloadavg()[0]:.1f}")  # fmt: skip
        wall_ratios = [r[0] / t[0] for r, t in zip(reads, trains, strict=True)]
        cpu_ratios = [r[1] / t[1] for r, t in zip(reads, trains, strict=True)]
        med = statistics.median
        rows.append(
            f"| {batch} × {seq} | {med(r[0] for r in reads):,.0f} | {med(r[1] for r in reads):,.0f} "
            f"| {preset} | {med(t[0] for t in trains):,.0f} | {med(t[1] for t in trains):,.0f} "
            f"| {med(wall_ratios):,.0f} × ({', '.join(f'{x:,.0f}' for x in wall_ratios)}) "
            f"| {med(cpu_ratios):,.0f} × ({', '.join(f'{x:,.0f}' for x in cpu_ratios)}) |"
        )
    return [
        "| batch × seq | reader tok/s | reader tok/CPU s | trainer preset | trainer tok/s | trainer tok/CPU s "
        "| reader ÷ trainer (wall; pairs) | reader ÷ trainer (CPU; pairs) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


# ---------------------------------------------------------------- memory


def _stdlib_texts() -> list[tuple[str, str]]:
    from dilocod.data.builtin import builtin_documents

    return [(d.key, d.text) for d in builtin_documents(1 << 40)]


def generated_documents(total_bytes: int, texts: list[tuple[str, str]]) -> Iterator[Document]:
    """Documents of about ``total_bytes`` bytes of text: the stdlib files again and again, each copy marked."""
    from dilocod.data.sources import Document

    left, copy = total_bytes, 0
    while left > 0:
        for key, text in texts:
            doc = f"# copy {copy}\n{text}"
            yield Document(f"copy-{copy}/{key}", doc)
            left -= len(doc.encode("utf-8"))
            if left <= 0:
                return
        copy += 1


def make_dataset(out: Path, mb: int, texts: list[tuple[str, str]]) -> tuple[float, float, int]:
    """Prepare ``mb`` MB of generated text into ``out``; (wall s, CPU s, bytes on disk)."""
    from dilocod.data.prepare import prepare
    from dilocod.data.tokenizer import BYTE

    if out.exists():
        shutil.rmtree(out)
    wall, cpu = time.perf_counter(), time.process_time()
    prepare(
        [], BYTE, out, eval_fraction=0.01, progress=False,
        documents=lambda: generated_documents(mb * MB, texts),
    )  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(p.stat().st_size for p in out.iterdir())


def _kib_fields(path: str) -> dict[str, int]:
    fields = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def _mapped_rss_kib(directory: Path) -> int:
    """RSS of this process's mappings of files under ``directory`` (the shards' mapped pages), in KiB."""
    total, inside = 0, False
    prefix = str(directory.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = line.rstrip().split()[-1].startswith(prefix)
        elif inside and first == "Rss:":
            total += int(line.split()[1])
    return total


def memory_snapshot(directory: Path) -> dict[str, int]:
    status = _kib_fields("/proc/self/status")
    out = {k: status[k] for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}
    try:
        rollup = _kib_fields("/proc/self/smaps_rollup")
        out.update(
            {
                k: rollup[k]
                for k in ("Pss", "Pss_Anon", "Pss_File", "Private_Clean", "Private_Dirty", "Anonymous")
                if k in rollup
            }
        )
        out["USS"] = rollup["Private_Clean"] + rollup["Private_Dirty"]
    except OSError:
        pass
    out["dataset_mapped"] = _mapped_rss_kib(directory)
    return out


def child(directory: Path, batches: int, batch: int, seq: int) -> None:
    """One peer's reader alone in this process: corpus, sampler, batches; print its memory as JSON."""
    import torch

    from dilocod.trainer.batches import DataConfig, ShardSampler, load_corpus

    torch.set_num_threads(1)
    before = memory_snapshot(directory)
    wall = time.perf_counter()
    corpus = load_corpus(DataConfig(path=str(directory)))
    opened = time.perf_counter() - wall
    sampler = ShardSampler(
        corpus.train, seed=0, peer_key="bench", num_shards=1, batch_size=batch, seq_len=seq
    )
    wall, cpu = time.perf_counter(), time.process_time()
    checksum = 0
    for position in range(batches):
        x, _ = sampler.batch(position)
        checksum += int(x[:, 0].sum())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = memory_snapshot(directory)
    print(json.dumps({
        "tokens": len(corpus.train), "open_s": opened, "before": before, "after": after,
        "read_tok_s": batches * batch * seq / wall, "read_tok_cpu_s": batches * batch * seq / max(cpu, 1e-9),
        "checksum": checksum,
    }))  # fmt: skip


def memory(args: argparse.Namespace) -> list[str]:
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    need = sum(2 * s * MB for s in sizes) * 1.1
    print(f"{base}: {free / 2**30:.1f} GiB free, need about {need / 2**30:.1f} GiB")
    if free < need + 2 * 2**30:
        raise SystemExit(f"{base}: not enough free disk space")
    texts = _stdlib_texts()
    print(
        f"generator: {len(texts)} stdlib files, {sum(len(t.encode()) for _, t in texts) / MB:.1f} MB a copy"
    )
    results = []
    try:
        for mb in sizes:
            out = base / f"bytes-{mb}mb"
            wall, cpu, disk = make_dataset(out, mb, texts)
            print(f"  prepared {mb} MB of text in {wall:.1f} s ({cpu:.1f} s CPU, {mb / wall:.1f} MB/s): "
                  f"{disk / MB:,.0f} MB on disk; load {os.getloadavg()[0]:.1f}")  # fmt: skip
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(out), "--batches", str(args.batches)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            a = got["after"]
            print(f"  {mb} MB: {json.dumps(a)}; corpus opened (verified) in {got['open_s']:.1f} s")
            results.append((mb, wall, cpu, disk, got))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    def mib(kib: int) -> str:
        return f"{kib / 1024:,.1f}"

    rows = []
    first = results[0][4]["after"]
    for mb, wall, cpu, disk, got in results:
        a, b = got["after"], got["before"]
        rows.append(
            f"| {mb:,} MB | {got['tokens']:,} | {disk / MB:,.0f} MB | {wall:.0f} s ({cpu:.0f} s CPU) "
            f"| {mib(a['VmHWM'])} ({a['VmHWM'] / first['VmHWM']:.3f}) | {mib(a['RssAnon'])} ({a['RssAnon'] / first['RssAnon']:.3f}) "
            f"| {mib(a['RssFile'])} | {mib(a['dataset_mapped'])} | {mib(a.get('Pss', 0))} | {mib(a.get('USS', 0))} "
            f"| {mib(a['RssAnon'] - b['RssAnon'])} | {got['read_tok_s']:,.0f} ({got['read_tok_cpu_s']:,.0f}/CPU s) |"
        )  # fmt: skip
    return [
        "| text | train tokens | on disk | prepare | peak RSS MiB (÷ first) | RssAnon MiB (÷ first) "
        "| RssFile MiB | of which dataset maps | PSS MiB | USS MiB | anon growth from corpus+reads | "
        f"{args.batches} batches 16×128, tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("all", "throughput", "memory"), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reader-seconds", type=float, default=2.0)
    parser.add_argument("--tiny-steps", type=int, default=8)
    parser.add_argument("--small-steps", type=int, default=2)
    parser.add_argument("--sizes-mb", default="100,2048")
    parser.add_argument("--dir", default="/tmp/bench-data")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--keep", action="store_true", help="keep the prepared datasets under --dir")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child), args.batches, 16, 128)
        return
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    tables = []
    if args.part in ("all", "throughput"):
        tables.append(throughput(args))
    if args.part in ("all", "memory"):
        tables.append(memory(args))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    for table in tables:
        print()
        print("\n".join(table))


if __name__ == "__main__":
    main()
