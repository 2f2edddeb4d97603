"""`dilocod status [URL]`: the run as a table, from a bootstrap's or a peer's HTTP API. A quick HTTP
client: it must not pay for importing torch and hivemind."""

from __future__ import annotations

import argparse
from typing import Any

from dilocod.commands.args import seconds


def add_parser(sub: Any) -> None:
    status = sub.add_parser(
        "status", help="print the run as a table, from a bootstrap's or a peer's HTTP API"
    )
    status.add_argument(
        "url", nargs="?", default="http://127.0.0.1:8080", help="node to ask (default http://127.0.0.1:8080)"
    )
    status.add_argument("-w", "--watch", action="store_true", help="redraw every --interval seconds")
    status.add_argument("--interval", type=seconds, default=2.0, help="seconds between redraws (default 2)")
    status.add_argument("--count", type=int, default=0, help="with --watch: stop after this many redraws")
    status.add_argument("--wide", action="store_true", help="full peer ids")


def run(args: argparse.Namespace) -> int:
    from dilocod.observability.statuscmd import run_status

    return run_status(args.url, watch=args.watch, interval=args.interval, count=args.count, wide=args.wide)
