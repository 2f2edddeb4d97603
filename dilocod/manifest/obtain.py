"""Which manifest a starting node runs with, and where it keeps it.

- Given peers, a node asks them (`peers/runinfo.py`), checks signature and signer (`adopt.trust_problem`)
  and adopts the first good one; if none answers in `FETCH_SECONDS`, a node that ran before keeps the one
  in its run dir (with a warning), a newcomer stops with one line.
- Given no peers, the node starts the run: the manifest in its run dir, or a new one of its own config
  (dataset and starting weights pinned by hash), signed with its identity.
- A bootstrap with a run dir keeps its manifest there: restarted, it serves the same one, and refuses a
  `--config`/`--set` that contradicts it (the keys named).

The manifest lives in `<run dir>/manifest.bin` (the signed record, exactly as served).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilocod.config import Config, ConfigError, config_from_raw
from dilocod.data.shards import load_index
from dilocod.files import atomic_write
from dilocod.manifest.adopt import adopt, conflicts, trust_problem
from dilocod.manifest.pindata import pin_dataset
from dilocod.manifest.pinhf import check_local_hf_config, pin_hf_config
from dilocod.manifest.record import Manifest, ManifestError, decode, differing_keys, issue, summary
from peers.auth import Identity, ensure_identity
from peers.errors import PeersError
from peers.node import parse_multiaddr
from peers.runinfo import Fetched, fetch_manifests

PinWeights = Callable[[Config], Config]  # a config with its starting weights pinned

log = logging.getLogger("dilocod.manifest")

FETCH_SECONDS = 30.0
MANIFEST_FILE = "manifest.bin"


@dataclass(frozen=True)
class Joined:
    config: Config
    manifest: Manifest


def load_stored(run_dir: Path | None) -> Manifest | None:
    """The manifest this node ran with before; a damaged file is named, set aside, and fetched anew."""
    if run_dir is None:
        return None
    path = run_dir / MANIFEST_FILE
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        return decode(blob)
    except ManifestError as e:
        aside = path.with_suffix(".bad")
        os.replace(path, aside)
        log.warning("%s: %s; moved it to %s and taking the run's manifest anew", path, e, aside.name)
        return None


def store(run_dir: Path, manifest: Manifest) -> None:
    atomic_write(run_dir / MANIFEST_FILE, [manifest.encode()])  # readers never see half a manifest


def peer_ids(initial_peers: Sequence[str]) -> list[str]:
    return [str(parse_multiaddr(text).value_for_protocol("p2p")) for text in initial_peers]


async def fetch(
    initial_peers: Sequence[str], pinned: Manifest | None, host: str, deadline: float = FETCH_SECONDS
) -> Manifest:
    """The first trustworthy manifest the given peers serve (PeersError if none in `deadline` seconds)."""
    given = peer_ids(initial_peers)
    chosen: list[Manifest] = []

    def accept(fetched: Fetched) -> bool:
        try:
            manifest = decode(fetched.blob)
        except ManifestError as e:
            log.warning("refused the manifest of %s: %s", fetched.served_by, e)
            return False
        problem = trust_problem(manifest, fetched.served_by, given, pinned)
        if problem is not None:
            log.warning("refused the manifest of %s: %s", fetched.served_by, problem)
            return False
        chosen.append(manifest)
        return True

    await fetch_manifests(initial_peers, deadline=deadline, accept=accept, host=_client_host(host))
    return chosen[0]


def _client_host(host: str) -> str:
    """Where the short-lived p2p client listens: loopback of the family of our listen address."""
    return "::1" if ":" in host else "127.0.0.1"


def default_run_dir(run_id: str) -> Path:
    return Path("runs") / run_id


async def manifest_for_peer(
    local_raw: dict[str, Any],
    run_dir: Path | None,
    initial_peers: Sequence[str],
    host: str,
    pin_weights: PinWeights,
) -> tuple[Joined, Path]:
    """The manifest and config a `dilocod join` runs with (see the module's docstring), and its run dir
    (`run_dir`, or runs/<the run's id> once the manifest names the run). `pin_weights`: see `pin_run`."""
    local = config_from_raw(local_raw)  # this machine's own settings are checked before anything else
    stored = load_stored(run_dir or default_run_dir(local.run.id))
    if initial_peers:
        try:
            manifest = await fetch(initial_peers, stored, host)
        except PeersError as e:
            if stored is None:
                raise ManifestError(str(e)) from None
            log.warning("%s; running with the manifest we stored (%s)", e, stored.hash[:12])
            manifest = stored
    else:
        manifest = stored or issue(
            pin_run(local, pin_weights), _identity(run_dir or default_run_dir(local.run.id))
        )
    final_dir = run_dir or default_run_dir(manifest.run_id)
    if final_dir != (run_dir or default_run_dir(local.run.id)):
        stored = load_stored(final_dir)
    if stored is not None and stored.hash != manifest.hash:
        log.warning(
            "the run's manifest changed since we last ran (%s → %s): %s",
            stored.hash[:12], manifest.hash[:12], ", ".join(differing_keys(stored, manifest)),
        )  # fmt: skip
    config = adopt(manifest, local_raw)
    check_local_hf_config(config)
    store(final_dir, manifest)
    return Joined(config, manifest), final_dir


def pin_run(config: Config, pin_weights: PinWeights) -> Config:
    """A new run's config with its dataset, then its model's transformers config (if any) and its starting
    weights pinned (hashes and content, not paths). `pin_weights` checks the starting weights and pins
    their hash (`dilocod/export/pininit.py`: reading a Hugging Face checkpoint is the export side's)."""
    config, directory = pin_dataset(config)
    return pin_weights(pin_hf_config(config, load_index(directory).vocab_size))


def _identity(run_dir: Path) -> Identity:
    """The node's identity key (made on first use): a run started here is signed with it."""
    return ensure_identity(run_dir / "identity.key")


async def manifest_for_bootstrap(
    local_raw: dict[str, Any],
    run_dir: Path | None,
    initial_peers: Sequence[str],
    identity_path: Path,
    host: str,
    pin_weights: PinWeights,
) -> Joined:
    """The manifest a bootstrap serves: its stored one, a linked bootstrap's, or a new one of its config."""
    stored = load_stored(run_dir)
    if stored is not None:
        manifest = stored
    elif initial_peers:
        try:
            manifest = await fetch(initial_peers, None, host)
        except PeersError as e:
            raise ManifestError(str(e)) from None
    else:
        manifest = issue(pin_run(config_from_raw(local_raw), pin_weights), ensure_identity(identity_path))
    lines = conflicts(manifest, local_raw)
    if lines:
        where = f"the manifest in {run_dir}" if stored is not None else "the run's manifest"
        raise ConfigError(f"your settings differ from {where}:\n" + "\n".join(lines))
    config = adopt(manifest, local_raw)
    check_local_hf_config(config)
    if run_dir is not None:
        store(run_dir, manifest)
    return Joined(config, manifest)


def joined_line(manifest: Manifest) -> str:
    return f"joined run '{manifest.run_id}' (manifest {manifest.hash[:12]}: {summary(manifest)})"
