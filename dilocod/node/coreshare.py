"""Training daemons on one machine share its cores: each trainer runs on its share of torch's threads.

torch gives every process one thread per core. Several peers on one machine (the demo, the tests, a user
trying a swarm, a box with two runs) then run N × cores threads, and OpenMP teams that wait for their
descheduled members at every op. Measured on 2 cores (tiny, batch 16 × 128, AdamW): two processes of 2
threads trained at 13,400 tokens/s each with short spin-waits (649 with libgomp's default, see
`runtime.calm_openmp_waits`), two of 1 thread at 17,500 each; four at 6,400 against 8,200.

So every CPU trainer claims its place in a registry on this machine, a directory of one small file per
training daemon (its CPUs and the threads it fixed, `trainer.threads`, or 0 for "my share"), each file
held under an exclusive `flock` while its daemon lives. A file whose lock can be taken belongs to a dead
daemon and is removed by whoever finds it. A daemon without fixed threads takes the cores its CPUs have,
less those the fixed daemons on the same CPUs hold, divided by the daemons taking a share; it reads the
registry again every `RECHECK_SECONDS` while it trains, so a peer that joins or leaves moves the others'
thread counts within seconds. Only what the files say is shared: daemons in other containers (another
/tmp) are not seen, and neither is other load.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dilocod.trainer.settings import TrainerConfig, cpu_threads, resolve_devices

log = logging.getLogger(__name__)

REGISTRY = Path(tempfile.gettempdir()) / "dilocod-trainers"
RECHECK_SECONDS = 5.0


@dataclass(frozen=True)
class Claim:
    """One training daemon's entry: the CPUs it may run on, and the threads it fixed (0: takes a share)."""

    cpus: frozenset[int]
    threads: int = 0


def share_threads(mine: Claim, claims: Sequence[Claim]) -> int:
    """Torch threads for the daemon of `mine` among every live claim on the machine (`mine` among them).

    Fixed claims keep their threads. A daemon taking a share gets the cores of its CPUs that the fixed
    claims on overlapping CPUs leave, divided by the share-takers on overlapping CPUs; at least 1."""
    if mine.threads > 0:
        return mine.threads
    near = [c for c in claims if c.cpus & mine.cpus]
    fixed = sum(c.threads for c in near if c.threads > 0)
    sharing = max(1, sum(1 for c in near if c.threads == 0))
    return max(1, (len(mine.cpus) - fixed) // sharing)


def machine_share(cfg: TrainerConfig) -> CoreShare | None:
    """The registered claim of a CPU trainer with `cfg` (None on a GPU, or for a config the trainer will
    refuse anyway). A peer training on N CPU ranks claims their N × threads as fixed."""
    try:
        devices = resolve_devices(cfg)
    except (ValueError, RuntimeError):
        return None
    if devices[0].type != "cpu":
        return None
    fixed = cfg.threads
    if len(devices) > 1:
        fixed = cpu_threads(cfg, devices[0], len(devices)) * len(devices)
    share = CoreShare(Claim(frozenset(os.sched_getaffinity(0)), fixed))
    share.register()
    return share


class CoreShare:
    """This daemon's claim in the machine's registry, and the threads its trainer should run now."""

    def __init__(self, claim: Claim, directory: Path = REGISTRY) -> None:
        self.claim, self.directory = claim, directory
        self._file: IO[str] | None = None
        self._name = ""

    def register(self) -> None:
        """Write and lock our file. Never fatal: without a registry the trainer keeps its own count."""
        try:
            self.directory.mkdir(mode=0o1777, parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):  # another user's directory: it is already 1777
                self.directory.chmod(0o1777)  # mkdir's mode goes through the umask
            self._name = f"{os.getpid()}-{secrets.token_hex(4)}.json"
            # Locked before it gets its name: a reader never sees our file without our lock on it.
            hidden = self.directory / f".{self._name}"
            file = hidden.open("w")
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            json.dump({"cpus": sorted(self.claim.cpus), "threads": self.claim.threads}, file)
            file.flush()
            os.chmod(hidden, 0o644)
            hidden.rename(self.directory / self._name)
            self._file = file
        except OSError as e:
            log.info(
                "cannot join the registry of training daemons in %s (%s): not sharing cores",
                self.directory,
                e,
            )

    def claims(self) -> list[Claim]:
        """Every live claim on this machine, ours included; dead daemons' files are removed."""
        found = [self.claim]
        try:
            names = [
                p for p in self.directory.iterdir() if not p.name.startswith(".") and p.name != self._name
            ]
        except OSError:
            return found
        for path in names:
            claim = _live_claim(path)
            if claim is not None:
                found.append(claim)
        return found

    @property
    def takes_a_share(self) -> bool:
        """Whether the trainer's thread count follows the registry (no threads fixed by config)."""
        return self.claim.threads == 0

    def threads(self) -> int:
        return share_threads(self.claim, self.claims())

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                (self.directory / self._name).unlink()
            self._file.close()
            self._file = None


def _live_claim(path: Path) -> Claim | None:
    """The claim in `path` if its daemon lives (holds the lock); a dead daemon's file is removed."""
    try:
        with path.open() as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    return None
                data = json.load(file)  # locked by a live daemon
                return Claim(frozenset(int(c) for c in data["cpus"]), int(data["threads"]))
            path.unlink()  # nobody holds it: its daemon is gone
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None
