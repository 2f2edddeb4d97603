"""`dilocod join [MULTIADDR…]`: take the run's manifest from its peers (or start a run), then train as one
peer until stopped (`dilocod/node/peer.py` is the daemon)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dilocod.commands.args import EXIT_NETWORK, EXIT_USAGE, fail, port


def add_parser(sub: Any) -> None:
    join = sub.add_parser("join", help="join a run (or start one) and train")
    join.add_argument(
        "peers", nargs="*", metavar="MULTIADDR", help="bootstrap/peer multiaddrs (/ip4/…/p2p/…)"
    )
    join.add_argument(
        "--config",
        type=Path,
        help="TOML config: this machine's own keys (and, with no peers given, a new run's settings); "
        "run-wide keys come from the run's manifest",
    )
    join.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    join.add_argument(
        "--run-dir", type=Path, default=None, help="checkpoint, identity and logs (default runs/<run.id>)"
    )
    join.add_argument("--host", help="listen address (overrides net.host)")
    join.add_argument("--port", type=port, help="listen port (overrides net.port)")
    join.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="public address to advertise, e.g. a port forward's (overrides net.announce; repeatable)",
    )
    join.add_argument("--http-host", default="127.0.0.1", help="address of the HTTP API (default 127.0.0.1)")
    join.add_argument("--http-port", type=port, help="serve /metrics and /api/status on this port")
    join.add_argument(
        "--devices",
        metavar="N|auto",
        help="local devices training as this one peer (overrides trainer.devices; auto = every GPU, 1 on CPU)",
    )
    join.add_argument("-v", "--verbose", action="store_true")


def join_overrides(args: argparse.Namespace) -> list[str]:
    """`--set` items plus what the join flags override (checked by the config like any other value)."""
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f'net.host="{args.host}"')
    if args.port is not None:
        overrides.append(f"net.port={args.port}")
    if args.devices is not None:
        overrides.append(f"trainer.devices={args.devices}")
    if args.announce:
        overrides.append(f"net.announce={json.dumps(list(args.announce))}")  # a TOML array of strings
    return overrides


def run(args: argparse.Namespace) -> int:
    from dilocod.config import ConfigError, config_from_raw, read_raw
    from dilocod.export.pininit import pin_init
    from dilocod.manifest.obtain import joined_line, manifest_for_peer
    from dilocod.manifest.record import ManifestError
    from dilocod.node.peer import PeerArgs, PeerDaemon
    from dilocod.node.runtime import (
        install_stop_signals,
        leave_cores_to_training,
        run_main,
        setup_logging,
    )
    from dilocod.trainer import LocalGroupError
    from peers.node import parse_multiaddr

    local_raw = read_raw(args.config, join_overrides(args))
    local = config_from_raw(local_raw)  # this machine's own keys fail here, before the network
    for text in args.peers:
        parse_multiaddr(text)
    for text in local.net.announce:
        parse_multiaddr(text, need_peer_id=False)
    setup_logging(None, verbose=args.verbose)

    async def _main() -> int:
        leave_cores_to_training()  # before any tensor work in this thread
        # The run's settings come from its manifest (dilocod/manifest/): fetched from the peers given, or,
        # with none, this peer starts the run with its own config.
        joined, run_dir = await manifest_for_peer(
            local_raw, args.run_dir, tuple(args.peers), local.net.host, pin_init
        )
        setup_logging(run_dir / "dilocod.log", verbose=args.verbose)
        print(joined_line(joined.manifest), flush=True)
        daemon = PeerDaemon(
            PeerArgs(
                joined.config, joined.manifest, run_dir, tuple(args.peers), args.http_host, args.http_port
            )
        )
        install_stop_signals(daemon.stopping)
        return await daemon.run()

    try:
        return run_main(_main())
    except (ConfigError, ManifestError):
        raise  # every line of it is the user's to read (main prints them)
    except ValueError as e:  # a checkpoint of another run, a state mismatch: the user's to fix
        return fail(str(e).split("\n")[0], EXIT_USAGE)
    except LocalGroupError as e:  # a local worker died (its own traceback is above)
        return fail(str(e), EXIT_NETWORK)
