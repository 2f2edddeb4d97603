"""Size and write time of one peer's checkpoint, for a preset, in one process (no swarm).

    .venv/bin/python bench/checkpoint_size.py [--preset 124m] [--dir /tmp/ckpt] [--json]

Builds what a peer holds (the trainer with AdamW after one inner step, θ_global and the outer momentum,
the int4 error-feedback residual), then writes the checkpoint the way the daemon does
(`checkpoint_payload` in the trainer thread, `save_checkpoint` in the background) and reports: the file's
size and bytes per parameter; the time to take the payload (the trainer thread's pause); the time until
the live tensors were read (when an outer step may go on) and until the file was whole (fsync and rename);
the bytes copied in memory for the write, against the old way (every tensor cloned first).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.codecs import ErrorFeedback  # noqa: E402
from dilocod.config import load_config  # noqa: E402
from dilocod.data.cursor import ChunkCursor  # noqa: E402
from dilocod.diloco import OuterOptimizer  # noqa: E402
from dilocod.node.resume import Resumed, checkpoint_payload  # noqa: E402
from dilocod.observability.peerstate import RoundProgress  # noqa: E402
from dilocod.rounds.tokens import TokenLedger  # noqa: E402
from dilocod.statesync.checkpoint import save_checkpoint  # noqa: E402
from dilocod.trainer import InnerTrainer  # noqa: E402


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def build(preset: str) -> tuple[Any, Resumed]:
    cfg = load_config(
        None,
        [f"model.preset={preset}", "trainer.batch_size=1", "trainer.seq_len=64", "trainer.optimizer=adamw",
         "trainer.warmup_steps=1", 'averaging.compression="int4"'],
    )  # fmt: skip
    trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="bench")
    trainer.train_steps(1)  # AdamW's moments exist from the first step
    outer = OuterOptimizer(trainer.working_params_fp32(), cfg.outer_settings())
    feedback = ErrorFeedback([p.shape for p in outer.params])
    return cfg, Resumed(trainer, outer, feedback, TokenLedger(), ChunkCursor(cfg.trainer.seq_len))


def measure(preset: str, directory: Path) -> dict[str, Any]:
    cfg, resumed = build(preset)
    params = sum(p.numel() for p in resumed.outer.params)
    started = time.perf_counter()
    payload = checkpoint_payload(cfg, resumed, RoundProgress())
    taken = time.perf_counter() - started
    copied = tensor_bytes(payload["trainer"])  # the only part cloned: inner steps change it
    read_at: list[float] = []
    begun = time.perf_counter()
    path = save_checkpoint(directory, payload, lambda: read_at.append(time.perf_counter() - begun))
    written = time.perf_counter() - begun
    size = path.stat().st_size
    return {
        "preset": preset,
        "parameters": params,
        "file_bytes": size,
        "bytes_per_parameter": round(size / params, 2),
        "payload_seconds": round(taken, 2),
        "tensors_read_seconds": round(read_at[0], 2),
        "written_seconds": round(written, 2),
        "write_mb_per_second": round(size / 1e6 / written, 1),
        "copied_bytes": copied,
        "copied_bytes_before": tensor_bytes(payload),  # every tensor was cloned before the write
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="124m")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.dir is not None:
        result = measure(args.preset, args.dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(args.preset, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
