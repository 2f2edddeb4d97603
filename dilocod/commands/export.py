"""`dilocod export` and `dilocod generate`. Errors are one line and exit code 2.

Importing this module is cheap (argparse only): the `dilocod` parser is built on every command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dilocod.commands.args import EXIT_INTERRUPTED, EXIT_USAGE, count, seconds, temperature


def add_export_parsers(sub: Any) -> None:
    """Register `export` and `generate` on the `dilocod` subparsers ``sub``."""
    exp = sub.add_parser("export", help="write a run's θ_global as a Hugging Face Llama model directory")
    where = exp.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="a peer's run directory (its checkpoint)")
    where.add_argument(
        "--from",
        dest="from_maddr",
        metavar="MULTIADDR",
        help="a node of a running swarm: take the θ_global its peers agree on, without training",
    )
    exp.add_argument("--out", type=Path, required=True, help="the new model directory (must not exist)")
    exp.add_argument(
        "--data-path",
        type=Path,
        help="the run's dataset directory, for its tokenizer (default <run dir>/data; with --from, fetched)",
    )
    exp.add_argument("--config", type=Path, help="with --from: this machine's keys (e.g. run.key)")
    exp.add_argument(
        "--wait",
        type=seconds,
        metavar="SECONDS",
        help="with --from: how long to wait for the peers' status records, and for most of them to agree on "
        "the θ_global downloaded (default 20)",
    )
    exp.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")

    gen = sub.add_parser("generate", help="sample text from a run's θ_global or an exported model")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="a peer's run directory (its θ_global)")
    src.add_argument("--model", type=Path, help="a model directory `dilocod export` wrote")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=count, default=64, help="default 64")
    gen.add_argument("--temperature", type=temperature, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=count, default=50, help="0 = no cut (default 50)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--data-path", type=Path, help="with --run-dir: the run's dataset directory")


def run_export(args: argparse.Namespace) -> int:
    """Run a parsed `dilocod export`; its exit code."""
    from dilocod.export.export import export_run

    def work() -> int:
        start = time.perf_counter()
        if args.from_maddr is not None:
            out = _export_from(args)
        else:
            out = export_run(args.run_dir, args.out, data_path=args.data_path)
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"wrote {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")
        return 0

    return _guarded(work)


def _export_from(args: argparse.Namespace) -> Path:
    """`export --from`: a short-lived node of the swarm (hivemind and p2pd), its logs on stderr."""
    from dilocod.config import config_from_raw, read_raw
    from dilocod.node.exportfrom import export_from
    from dilocod.node.runtime import run_main, setup_logging

    local_raw = read_raw(args.config, args.overrides)
    config_from_raw(local_raw)  # this machine's own keys fail here, before the network
    setup_logging(None)
    result: list[Path] = []

    async def main() -> int:
        result.append(
            await export_from(
                args.from_maddr, args.out, local_raw, data_path=args.data_path, record_seconds=args.wait
            )
        )
        return 0

    run_main(main())
    return result[0]


def run_generate(args: argparse.Namespace) -> int:
    """Run a parsed `dilocod generate`; its exit code. Prints the prompt and what follows it."""
    from dilocod.export.generate import generate

    def work() -> int:
        text = generate(
            args.model or args.run_dir, args.prompt, args.max_new_tokens, args.temperature,
            args.top_k, args.seed, data_path=args.data_path, exported=args.model is not None,
        )  # fmt: skip
        print(args.prompt + text)
        return 0

    return _guarded(work)


def _guarded(work: Any) -> int:
    """`work()`, with every error a user can cause as one line and exit code 2."""
    from dilocod.config import ConfigError
    from dilocod.data.errors import DataError
    from dilocod.export.errors import ExportError
    from dilocod.statesync.checkpoint import CheckpointError

    try:
        return int(work())
    except (ExportError, CheckpointError, DataError, ConfigError) as e:
        print(f"dilocod: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. no space left or no permission where the model goes
        print(f"dilocod: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
