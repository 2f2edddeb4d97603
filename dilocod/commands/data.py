"""`dilocod data ...`: train a tokenizer, prepare a dataset. Errors are one line and exit code 2.

Importing this module is cheap (argparse only): the `dilocod` parser is built on every command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dilocod.commands.args import EXIT_INTERRUPTED, EXIT_USAGE


def add_data_parser(sub: Any) -> None:
    """Register `data` and its commands on the `dilocod` subparsers ``sub``."""
    data = sub.add_parser("data", help="prepare a tokenized dataset (and train its tokenizer)")
    cmds = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")

    tok = cmds.add_parser("tokenizer", help="train a byte-level BPE tokenizer on text")
    tok.add_argument(
        "sources", nargs="+", type=Path, metavar="SOURCE", help="text/JSONL/Parquet files or dirs"
    )
    tok.add_argument("--vocab-size", type=int, required=True, help="tokens, <|endoftext|> included")
    tok.add_argument("--out", type=Path, required=True, help="where to write tokenizer.json")
    tok.add_argument("--text-field", default="text", help="JSONL field / Parquet column (default text)")

    prep = cmds.add_parser("prepare", help="tokenize sources into a sharded dataset directory")
    prep.add_argument(
        "sources", nargs="+", type=Path, metavar="SOURCE", help="text/JSONL/Parquet files or dirs"
    )
    prep.add_argument("--tokenizer", required=True, help='"byte" or a tokenizer.json')
    prep.add_argument("--out", type=Path, required=True, help="the dataset directory")
    prep.add_argument("--text-field", default="text", help="JSONL field / Parquet column (default text)")
    prep.add_argument("--eval-fraction", type=float, default=0.01, help="documents held out (default 0.01)")
    prep.add_argument("--shard-tokens", type=int, default=2**24, help="tokens per shard (default 2^24)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_data(args: argparse.Namespace) -> int:
    """Run a parsed `dilocod data ...` command; its exit code."""
    from dilocod.data.errors import DataError

    try:
        if args.data_command == "tokenizer":
            return _tokenizer(args)
        return _prepare(args)
    except DataError as e:
        print(f"dilocod: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _tokenizer(args: argparse.Namespace) -> int:
    from dilocod.data.tokenizer import train_bpe

    out = train_bpe(args.sources, args.vocab_size, args.out, text_field=args.text_field)
    print(f"wrote {out} ({args.vocab_size} tokens)")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from dilocod.data.prepare import prepare

    start, wall = time.perf_counter(), time.time()
    index = prepare(
        args.sources,
        args.tokenizer,
        args.out,
        text_field=args.text_field,
        eval_fraction=args.eval_fraction,
        shard_tokens=args.shard_tokens,
        progress=not args.no_progress,
    )
    seconds = max(time.perf_counter() - start, 1e-9)
    tokens = index.train.tokens + index.eval.tokens
    fresh = (args.out / "index.json").stat().st_mtime >= wall - 1  # else it was up to date already
    print(
        f"dataset {index.hash}: train {index.train.tokens} tokens ({len(index.train.shards)} shards), "
        f"eval {index.eval.tokens} tokens ({len(index.eval.shards)} shards), "
        + (f"{tokens / seconds:,.0f} tokens/s" if fresh else "up to date")
    )
    return 0
