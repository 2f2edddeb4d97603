"""The inner optimizer (`trainer.optimizer`): AdamW, or Muon with AdamW (MuLoCo).

- `adamw`: AdamW on every parameter (weight decay on matrices only: decaying RMSNorm gains just fights
  the normalisation).
- `muon`: Muon (`muon.py`: torch's, with its orthogonalisation in bf16 only where the machine multiplies bf16
  fast, `precision.py`) for the 2-D weight matrices of the transformer blocks (attention and MLP
  projections), AdamW as above for the rest — the embedding, the norms and the output head, for which
  orthogonalised updates are not meant. Muon as the inner optimizer is reported to tolerate coarse
  (2-bit) outer compression better than AdamW (MuLoCo, 2025). Muon runs with
  `adjust_lr_fn="match_rms_adamw"` (Moonshot's scaling: 0.2·√max(A, B)), whose updates have AdamW's
  RMS, so both take the same lr schedule and weight decay; `trainer.muon_lr_ratio` scales Muon's lr
  (the `lr_scale` of its parameter group) if it needs its own.

Both are stepped at every inner step. The trainer only needs the interface of one torch optimizer
(`param_groups`, `step`, `zero_grad`, `state_dict`, `load_state_dict`), which `MuonWithAdamW` provides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .muon import Muon

OPTIMIZERS = ("adamw", "muon")
ADAMW_BETAS = (0.9, 0.95)


class MuonWithAdamW:
    """Muon for the blocks' matrices and AdamW for the rest, stepped together as one optimizer.

    `state_dict()` is `{"muon": ..., "adamw": ...}`, each part in its torch format.
    """

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW) -> None:
        self.parts: dict[str, torch.optim.Optimizer] = {"muon": muon, "adamw": adamw}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.keys() != self.parts.keys():
            raise ValueError("a Muon+AdamW optimizer state needs exactly the parts 'muon' and 'adamw'")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


InnerOptimizer = torch.optim.AdamW | MuonWithAdamW


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Muon takes the 2-D weight matrices inside the transformer blocks; embedding and head stay on AdamW."""
    return name.startswith("blocks.") and param.ndim == 2


def make_inner_optimizer(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    muon_lr_ratio: float = 1.0,
    fused: bool = False,
    muon_matrix: Callable[[str, torch.Tensor], bool] = uses_muon,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> InnerOptimizer:
    """The optimizer `trainer.optimizer` names, over `named_params` (in the trainer's order); `muon_matrix`
    picks the parameters Muon takes (the model's hidden matrices), `ns_dtype` the dtype of Muon's
    orthogonalisation."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"trainer.optimizer must be one of {', '.join(OPTIMIZERS)}, got '{kind}'")
    muon = [p for name, p in named_params if kind == "muon" and muon_matrix(name, p)]
    taken = {id(p) for p in muon}
    rest = [p for _, p in named_params if id(p) not in taken]
    groups = [
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, eps=1e-8, fused=fused)
    if kind == "adamw":
        return adamw
    muon_optimizer = Muon(
        [{"params": muon, "lr_scale": muon_lr_ratio}],
        ns_dtype=ns_dtype,
        lr=lr * muon_lr_ratio,
        weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonWithAdamW(muon_optimizer, adamw)


def with_saved_moments(optimizer: InnerOptimizer, saved: Any) -> dict[str, Any]:
    """`optimizer`'s own state dict with the per-parameter moments taken from `saved` (same format).

    Keeps this optimizer's hyper-parameters (current config, fused flag for this device). Raises
    ValueError, before anything is loaded, if `saved` is malformed or has other parameter groups.
    """
    if isinstance(optimizer, MuonWithAdamW):
        if not isinstance(saved, dict) or saved.keys() != optimizer.parts.keys():
            raise ValueError(
                "trainer state has a malformed optimizer state (expected parts 'muon' and 'adamw')"
            )
        return {name: _with_moments(part, saved[name]) for name, part in optimizer.parts.items()}
    return _with_moments(optimizer, saved)


def _with_moments(optimizer: torch.optim.Optimizer, saved: Any) -> dict[str, Any]:
    try:
        saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
        moments = saved["state"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"trainer state has a malformed optimizer state ({exc!r})") from None
    current = optimizer.state_dict()
    if saved_sizes != [len(g["params"]) for g in current["param_groups"]]:
        raise ValueError("trainer state's optimizer does not match this model's parameter groups")
    current["state"] = moments
    return current
