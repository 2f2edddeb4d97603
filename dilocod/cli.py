"""`dilocod`: the command line. Every user error is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dilocod import DEFAULT_RUN_ID, __version__

EXIT_USAGE = 2
EXIT_NETWORK = 1


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..65535")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} seconds is out of range 0.1..3600")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dilocod", description="Decentralized DiLoCo training, peer to peer."
    )
    parser.add_argument("--version", action="version", version=f"dilocod {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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
    join.add_argument("--port", type=_port, help="listen port (overrides net.port)")
    join.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="public address to advertise, e.g. a port forward's (overrides net.announce; repeatable)",
    )
    join.add_argument("--http-host", default="127.0.0.1", help="address of the HTTP API (default 127.0.0.1)")
    join.add_argument("--http-port", type=_port, help="serve /metrics and /api/status on this port")
    join.add_argument(
        "--devices",
        metavar="N|auto",
        help="local devices training as this one peer (overrides trainer.devices; auto = every GPU, 1 on CPU)",
    )
    join.add_argument("-v", "--verbose", action="store_true")

    boot = sub.add_parser("bootstrap", help="run a public bootstrap node with the run dashboard")
    boot.add_argument("peers", nargs="*", metavar="MULTIADDR", help="other bootstrap nodes to link with")
    boot.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    boot.add_argument("--port", type=_port, default=31337, help="listen port (default 31337)")
    boot.add_argument(
        "--announce", action="append", default=[], metavar="MULTIADDR", help="public address to advertise"
    )
    boot.add_argument("--http-host", default="0.0.0.0", help="dashboard address (default 0.0.0.0)")
    boot.add_argument("--http-port", type=_port, help="serve the dashboard, /api/run and /metrics here")
    boot.add_argument("--run-id", help=f"the run to serve (default: the config's run.id, {DEFAULT_RUN_ID})")
    boot.add_argument("--config", type=Path, help="the run's TOML config (model shapes and deadlines)")
    boot.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    boot.add_argument(
        "--no-reduce",
        action="store_true",
        help="do not reduce for the run (peers behind NAT then need another)",
    )
    boot.add_argument(
        "--relay",
        action="store_true",
        help="relay pseudo-gradients between peers behind NAT (py-libp2p circuit relay, `make relay`)",
    )
    boot.add_argument(
        "--relay-port",
        type=_port,
        default=0,
        help="first of the relay's 4 ports (default: --port + 1, or free ports with --port 0)",
    )
    boot.add_argument(
        "--init-from",
        type=Path,
        metavar="HF_DIR",
        help="start the run from a local Hugging Face Llama checkpoint (config.json + model.safetensors) of "
        "the run's preset and vocabulary (sets model.init_from; the manifest pins its sha256)",
    )
    boot.add_argument("--maddr-file", type=Path, help="also write the multiaddrs to this file")
    boot.add_argument("--identity", type=Path, help="key file for a stable peer id across restarts")
    boot.add_argument(
        "--run-dir",
        type=Path,
        help="the run's home: identity, manifest and log (restarted with it: same peer id, same manifest)",
    )
    boot.add_argument("-v", "--verbose", action="store_true")

    demo = sub.add_parser("demo", help="a whole local swarm on loopback: bootstrap + N peers")
    demo.add_argument("--peers", type=int, default=3, help="number of training peers (default 3)")
    demo.add_argument("--config", type=Path, default=None, help="peer config (default configs/tiny.toml)")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    demo.add_argument("--http-port", type=_port, default=8080, help="dashboard port (default 8080, 0 = any)")
    demo.add_argument(
        "--run-dir", type=Path, default=Path("runs/demo"), help="where the peers keep their files"
    )
    demo.add_argument("--rounds", type=int, default=0, help="stop after this many outer rounds (0 = never)")

    status = sub.add_parser(
        "status", help="print the run as a table, from a bootstrap's or a peer's HTTP API"
    )
    status.add_argument(
        "url", nargs="?", default="http://127.0.0.1:8080", help="node to ask (default http://127.0.0.1:8080)"
    )
    status.add_argument("-w", "--watch", action="store_true", help="redraw every --interval seconds")
    status.add_argument("--interval", type=_seconds, default=2.0, help="seconds between redraws (default 2)")
    status.add_argument("--count", type=int, default=0, help="with --watch: stop after this many redraws")
    status.add_argument("--wide", action="store_true", help="full peer ids")
    config = sub.add_parser("config", help="print the configuration reference (docs/configuration.md)")
    config.add_argument(
        "--reference",
        action="store_true",
        required=True,
        help="every key by section: type, default, run-wide or local, what it does (from the code)",
    )
    from dilocod.data.cli import add_data_parser

    add_data_parser(sub)
    from dilocod.export.cli import add_export_parsers

    add_export_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":  # a quick HTTP client: it must not pay for importing torch and hivemind
        from dilocod.observability.statuscmd import run_status

        return run_status(
            args.url, watch=args.watch, interval=args.interval, count=args.count, wide=args.wide
        )
    if args.command == "config":  # offline: the config dataclasses only
        from dilocod.config_reference import MissingDocs, reference

        try:
            sys.stdout.write(reference())
        except MissingDocs as e:
            return _fail(str(e), EXIT_USAGE)
        return 0
    if args.command == "data":  # offline, no network: nor does it need hivemind
        from dilocod.data.cli import run_data

        return run_data(args)
    if args.command in ("export", "generate"):  # files and torch (export --from: a short-lived node)
        from dilocod.export.cli import run_export, run_generate

        return run_export(args) if args.command == "export" else run_generate(args)
    from dilocod.processes.memory import cap_malloc_arenas

    cap_malloc_arenas()  # before torch and hivemind start their threads: they take arenas as they go
    from dilocod.config import ConfigError
    from dilocod.manifest.record import ManifestError
    from dilocod.statesync.checkpoint import CheckpointError
    from dilocod.trainer import DataError
    from peers.errors import PeersError

    try:
        if args.command == "join":
            return _join(args)
        if args.command == "bootstrap":
            return _bootstrap(args)
        return _demo(args)
    except (ConfigError, ManifestError, CheckpointError, DataError) as e:
        return _fail(str(e), EXIT_USAGE)
    except PeersError as e:
        return _fail(str(e), EXIT_USAGE if str(e).startswith("bad multiaddr") else EXIT_NETWORK)
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The `dilocod` command (and `python -m dilocod`): `main`, then exit without tearing the interpreter
    down. By then the daemon has stopped its children and written its checkpoint; the teardown of torch,
    hivemind and their objects only made every stop about 2 s slower (3 peers on 2 cores measured it)."""
    from dilocod.processes.runtime import calm_openmp_waits

    calm_openmp_waits()  # before anything imports torch
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _fail(message: str, code: int) -> int:
    """Print `message` (a line per problem, e.g. one per contradicted key) and return `code`."""
    for line in message.splitlines() or [""]:
        print(f"dilocod: error: {line}", file=sys.stderr)
    return code


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


def _join(args: argparse.Namespace) -> int:
    from dilocod.config import ConfigError, config_from_raw, read_raw
    from dilocod.manifest.obtain import joined_line, manifest_for_peer
    from dilocod.manifest.record import ManifestError
    from dilocod.processes.peer import PeerArgs, PeerDaemon
    from dilocod.processes.runtime import (
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
        joined, run_dir = await manifest_for_peer(local_raw, args.run_dir, tuple(args.peers), local.net.host)
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
        return _fail(str(e).split("\n")[0], EXIT_USAGE)
    except LocalGroupError as e:  # a local worker died (its own traceback is above)
        return _fail(str(e), EXIT_NETWORK)


def _bootstrap(args: argparse.Namespace) -> int:
    from dilocod.config import config_from_raw, read_raw
    from dilocod.manifest.obtain import manifest_for_bootstrap
    from dilocod.processes.dataset import bootstrap_dataset
    from dilocod.processes.initweights import served_init
    from dilocod.processes.runtime import run_main, setup_logging
    from peers.node import parse_multiaddr

    for text in args.peers:
        parse_multiaddr(text)
    for text in args.announce:
        parse_multiaddr(text, need_peer_id=False)
    if args.relay:
        from peers.relay import relay_available

        if (missing := relay_available()) is not None:
            return _fail(f"--relay: {missing}", EXIT_USAGE)
    overrides = [*args.overrides, *([f'run.id="{args.run_id}"'] if args.run_id is not None else [])]
    if args.init_from is not None:  # a TOML string (json.dumps escapes as TOML's basic strings do)
        overrides.append(f"model.init_from={json.dumps(str(args.init_from.expanduser().resolve()))}")
    local_raw = read_raw(args.config, overrides)
    config_from_raw(local_raw)  # this machine's own keys fail here, before the network
    setup_logging(args.run_dir / "bootstrap.log" if args.run_dir else None, verbose=args.verbose)
    identity = args.identity or (args.run_dir / "identity.key" if args.run_dir else None)

    async def _main() -> int:
        with contextlib.ExitStack() as stack:
            # Without a run dir or --identity the bootstrap's identity lives as long as it runs.
            key = (
                identity
                or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dilocod-"))) / "id.key"
            )
            joined = await manifest_for_bootstrap(local_raw, args.run_dir, tuple(args.peers), key, args.host)
            joined = await bootstrap_dataset(joined, args.run_dir, tuple(args.peers), args.host)
            # The starting weights, checked against the manifest before we serve them (a restarted
            # bootstrap given other weights stops here).
            files = await asyncio.to_thread(served_init, joined.config)
            print(f"run '{joined.manifest.run_id}': manifest {joined.manifest.hash}", flush=True)
            return await _serve_bootstrap(args, joined, key, files)

    return run_main(_main())


async def _serve_bootstrap(
    args: argparse.Namespace, joined: Any, identity: Path, files: dict[str, Path]
) -> int:
    from dilocod.processes.bootstrap import BootstrapArgs, BootstrapDaemon
    from dilocod.processes.runtime import install_stop_signals

    boot_args = BootstrapArgs(
        run_id=joined.config.run.id,
        host=args.host,
        port=args.port,
        http_host=args.http_host,
        http_port=args.http_port,
        maddr_file=args.maddr_file,
        identity_path=identity,
        announce=tuple(args.announce),
        initial_peers=tuple(args.peers),
        config=joined.config,
        manifest=joined.manifest,
        run_dir=args.run_dir,
        reduce=not args.no_reduce,
        relay=args.relay,
        relay_port=args.relay_port,
        serve_files=files,
    )
    daemon = BootstrapDaemon(boot_args)
    install_stop_signals(daemon.stopping)
    return await daemon.run()


def _demo(args: argparse.Namespace) -> int:
    from dilocod.config import load_config
    from dilocod.processes.demo import DemoArgs, run_demo

    if args.peers < 1:
        return _fail(f"--peers must be at least 1, got {args.peers}", EXIT_USAGE)
    config_path = args.config or Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"
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


if __name__ == "__main__":
    sys.exit(main())
