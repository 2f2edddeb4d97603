"""Small stand-ins shared by unit tests of the round protocol (no processes, no network)."""

from __future__ import annotations

import torch


class FakeTrainer:
    """What the round pipeline needs of a trainer: a working copy to read and write."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p.clone() for p in params]

    def working_params_fp32(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.params]

    def load_params(self, tensors: list[torch.Tensor]) -> None:
        self.params = [t.clone() for t in tensors]
