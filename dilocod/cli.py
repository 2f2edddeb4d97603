"""`dilocod`: the command line. It builds the parser from the subcommands' modules (`dilocod/commands/`)
and dispatches to them. Every user error is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from dilocod import __version__
from dilocod.commands import bootstrap, data, demo, export, join, reference, status
from dilocod.commands.args import EXIT_INTERRUPTED, EXIT_NETWORK, EXIT_USAGE, fail

__all__ = ["EXIT_NETWORK", "EXIT_USAGE", "entry", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dilocod", description="Decentralized DiLoCo training, peer to peer."
    )
    parser.add_argument("--version", action="version", version=f"dilocod {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (join, bootstrap, demo, status, reference):
        command.add_parser(sub)
    data.add_data_parser(sub)
    export.add_export_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":  # a quick HTTP client: it must not pay for importing torch and hivemind
        return status.run(args)
    if args.command == "config":  # offline: the config dataclasses only
        return reference.run(args)
    if args.command == "data":  # offline, no network: nor does it need hivemind
        return data.run_data(args)
    if args.command in ("export", "generate"):  # files and torch (export --from: a short-lived node)
        return export.run_export(args) if args.command == "export" else export.run_generate(args)
    return _node(args)


def _node(args: argparse.Namespace) -> int:
    """`join`, `bootstrap` and `demo`: the commands that run nodes."""
    from dilocod.node.memory import cap_malloc_arenas

    cap_malloc_arenas()  # before torch and hivemind start their threads: they take arenas as they go
    from dilocod.config import ConfigError
    from dilocod.manifest.record import ManifestError
    from dilocod.statesync.checkpoint import CheckpointError
    from dilocod.trainer import DataError
    from peers.errors import PeersError

    try:
        if args.command == "join":
            return join.run(args)
        if args.command == "bootstrap":
            return bootstrap.run(args)
        return demo.run(args)
    except (ConfigError, ManifestError, CheckpointError, DataError) as e:
        return fail(str(e), EXIT_USAGE)
    except PeersError as e:
        return fail(str(e), EXIT_USAGE if str(e).startswith("bad multiaddr") else EXIT_NETWORK)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def entry() -> NoReturn:
    """The `dilocod` command (and `python -m dilocod`): `main`, then exit without tearing the interpreter
    down. By then the daemon has stopped its children and written its checkpoint; the teardown of torch,
    hivemind and their objects only made every stop about 2 s slower (3 peers on 2 cores measured it)."""
    from dilocod.node.runtime import calm_openmp_waits

    calm_openmp_waits()  # before anything imports torch
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
