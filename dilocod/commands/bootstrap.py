"""`dilocod bootstrap [MULTIADDR…]`: the run's long-lived public node: it holds and serves the signed
manifest, seeds the DHT, reduces and relays for peers behind NAT, and serves the dashboard
(`dilocod/node/bootstrap.py` is the daemon)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

from dilocod import DEFAULT_RUN_ID
from dilocod.commands.args import EXIT_USAGE, fail, port


def add_parser(sub: Any) -> None:
    boot = sub.add_parser("bootstrap", help="run a public bootstrap node with the run dashboard")
    boot.add_argument("peers", nargs="*", metavar="MULTIADDR", help="other bootstrap nodes to link with")
    boot.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    boot.add_argument("--port", type=port, default=31337, help="listen port (default 31337)")
    boot.add_argument(
        "--announce", action="append", default=[], metavar="MULTIADDR", help="public address to advertise"
    )
    boot.add_argument("--http-host", default="0.0.0.0", help="dashboard address (default 0.0.0.0)")
    boot.add_argument("--http-port", type=port, help="serve the dashboard, /api/run and /metrics here")
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
        type=port,
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


def run(args: argparse.Namespace) -> int:
    from dilocod.config import config_from_raw, read_raw
    from dilocod.export.pininit import pin_init
    from dilocod.manifest.obtain import manifest_for_bootstrap
    from dilocod.node.dataset import bootstrap_dataset
    from dilocod.node.initweights import served_init
    from dilocod.node.runtime import run_main, setup_logging
    from peers.node import parse_multiaddr

    for text in args.peers:
        parse_multiaddr(text)
    for text in args.announce:
        parse_multiaddr(text, need_peer_id=False)
    if args.relay:
        from peers.relay import relay_available

        if (missing := relay_available()) is not None:
            return fail(f"--relay: {missing}", EXIT_USAGE)
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
            joined = await manifest_for_bootstrap(
                local_raw, args.run_dir, tuple(args.peers), key, args.host, pin_init
            )
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
    from dilocod.node.bootstrap import BootstrapArgs, BootstrapDaemon
    from dilocod.node.runtime import install_stop_signals

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
