"""`[data]`: what the run trains on, and where this machine keeps it.

A run trains on one prepared dataset (`dilocod data prepare`), named by the sha256 of its index: that hash,
not a path, is the run-wide setting (`data.dataset`, written into the manifest by the node that starts the
run). Everything else here is local: the source the starting node prepares or takes the dataset from, how
it prepares a source that is not prepared yet, where this machine keeps the files, and how fast it serves
them to other peers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class DataConfig:
    """The ``[data]`` section of the config file."""

    # The node that starts the run: "builtin" (the running Python's standard library, prepared once per
    # machine), a prepared dataset directory, or text/JSONL/Parquet files or a directory to prepare.
    source: str = "builtin"
    # The tokenizer a source that is not prepared yet is prepared with: "byte" or a tokenizer.json path.
    tokenizer: str = "byte"
    text_field: str = "text"  # the text field of JSONL records and Parquet rows
    eval_fraction: float = 0.02  # share of documents held out for eval when preparing (by document hash)
    max_bytes: int = 64 * 2**20  # the builtin corpus's text is cut here
    num_shards: int = (
        16  # without the chunk schedule (no pinned dataset): a peer samples one of this many parts
    )
    dataset: str = (
        ""  # run-wide: the prepared dataset's index hash ("" until the run's starting node sets it)
    )
    path: str = ""  # where this machine keeps the run's dataset ("" = <run dir>/data)
    serve_bandwidth: float = (
        0.0  # Mbit/s this node serves dataset files to other peers with at most (0: no cap)
    )
    # the TCP port this node also serves dataset files on over plain HTTP, cheaper per byte than p2p (0: any
    # free port; -1: none); a joiner that cannot reach it (NAT, firewall) fetches over p2p
    bulk_port: int = 0
    # The coordinator's (bootstrap's): tokens per chunk of the run's chunk schedule (each trained once an
    # epoch); 0: no schedule (every peer samples random windows of its part of the split)
    chunk_tokens: int = 1 << 20
    # The coordinator's: seconds a chunk lease lives without its trainer's report, then the chunk goes back
    lease_seconds: float = 300.0

    def validate(self) -> None:
        if not self.source:
            raise ValueError(
                "data.source must be 'builtin', a prepared dataset directory or a path to prepare"
            )
        if not self.tokenizer:
            raise ValueError("data.tokenizer must be 'byte' or a path to a tokenizer.json")
        if not self.text_field:
            raise ValueError("data.text_field must be a non-empty string")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.num_shards < 1:
            raise ValueError(f"data.num_shards must be >= 1, got {self.num_shards}")
        if self.max_bytes < 2:
            raise ValueError(f"data.max_bytes must be >= 2, got {self.max_bytes}")
        if self.dataset and not _SHA256.match(self.dataset):
            raise ValueError(
                f"data.dataset must be a dataset's index hash (64 hex digits), got '{self.dataset}'"
            )
        if self.chunk_tokens < 0:
            raise ValueError(
                f"data.chunk_tokens must be >= 0 (0: no chunk schedule), got {self.chunk_tokens}"
            )
        if not (math.isfinite(self.lease_seconds) and self.lease_seconds > 0):
            raise ValueError(f"data.lease_seconds must be > 0, got {self.lease_seconds}")
        if not -1 <= self.bulk_port <= 65535:
            raise ValueError(
                f"data.bulk_port must be a port, 0 (any free port) or -1 (none), got {self.bulk_port}"
            )
        if not (math.isfinite(self.serve_bandwidth) and self.serve_bandwidth >= 0):
            raise ValueError(
                f"data.serve_bandwidth must be >= 0 (Mbit/s; 0 = no cap), got {self.serve_bandwidth}"
            )
