"""`dilocod demo`: a whole local swarm on loopback, a bootstrap and N peers (`dilocod/node/demo.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dilocod.commands.args import EXIT_USAGE, fail, port


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="a whole local swarm on loopback: bootstrap + N peers")
    demo.add_argument("--peers", type=int, default=3, help="number of training peers (default 3)")
    demo.add_argument("--config", type=Path, default=None, help="peer config (default configs/tiny.toml)")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    demo.add_argument("--http-port", type=port, default=8080, help="dashboard port (default 8080, 0 = any)")
    demo.add_argument(
        "--run-dir", type=Path, default=Path("runs/demo"), help="where the peers keep their files"
    )
    demo.add_argument("--rounds", type=int, default=0, help="stop after this many outer rounds (0 = never)")


def run(args: argparse.Namespace) -> int:
    from dilocod.config import load_config
    from dilocod.node.demo import DemoArgs, run_demo

    if args.peers < 1:
        return fail(f"--peers must be at least 1, got {args.peers}", EXIT_USAGE)
    config_path = args.config or Path(__file__).resolve().parent.parent.parent / "configs" / "tiny.toml"
    load_config(config_path, args.overrides)  # fail here, once, rather than in every peer
    return run_demo(
        DemoArgs(
            peers=args.peers,
            config=config_path,
            overrides=tuple(args.overrides),
            http_port=args.http_port,
            run_dir=args.run_dir,
            rounds=args.rounds,
        )
    )
