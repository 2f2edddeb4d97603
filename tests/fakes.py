"""Small stand-ins shared by unit tests of the round protocol (no processes, no network)."""

from __future__ import annotations

import torch

from proto import encode_ticket


class FakeTrainer:
    """What the round pipeline needs of a trainer: a working copy to read and write."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.working = [p.clone() for p in params]

    def params(self) -> list[torch.Tensor]:
        return list(self.working)

    def working_params_fp32(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.working]

    def load_params(self, tensors: list[torch.Tensor]) -> None:
        self.working = [t.clone() for t in tensors]


def round_ticket(step: int, num_params: int, sha: str = "a" * 64) -> bytes:
    """An honest peer's round ticket (`proto.ROUND_TICKET`) for in-process averaging tests."""
    return encode_ticket(
        {
            "outer_step": step,
            "global_sha256": sha,
            "num_params": num_params,
            "role": "peer",
            "tokens": 1000,
            "tokens_per_second": 100.0,
            "train_seconds": 10.0,
            "manifest_hash": "ab" * 32,
        }
    )
