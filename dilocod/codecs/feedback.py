"""Error feedback: each peer remembers what its codec dropped and sends it again next round.

Per round, with Δ the pseudo-gradient and e the residual (zero at start):

    sent = Δ + e                        (`compensate`)
    transmitted = decode(encode(sent))  (`roundtrip`, or whatever the wire actually carried)
    e ← sent − transmitted              (`update`)

so nothing the codec drops is lost, only delayed. With a decay β < 1 (`averaging.ef_decay`, meant for the
sparse `topk` codec, whose residual holds most of Δ) the carried part fades: sent = Δ + β·e, the form
SparseLoCo writes as e ← β·e + Δ, send C(e), e ← e − C(e); β = 1 is the plain feedback above, bit for bit. With the blockwise codecs the residual stays
bounded: each element's error is at most ρ·(block absmax of Δ + e), ρ = (1 + 2^-7)(1 + 2^-15)/3 for int2
(/15 for int4, /254 for int8), hence by induction ‖e‖∞ ≤ ρ/(1 − ρ)·sup_t ‖Δ_t‖∞ per block — about
0.51·max|Δ| for int2, 0.072 for int4. The residual is local state (never sent), so it does not need
to be bit-identical across peers. It lives on the CPU, in fp32 or, by default, in bf16
(`averaging.residual_dtype`): e is then rounded to 8 significant bits when stored, so a round loses at
most 2^-8 of e (for int4 ≤ 2.8e-4 of the block's max |Δ|, ~1/240 of what the codec itself drops), for 2
bytes a parameter less. The arithmetic is fp32 either way, each update one plain add or subtract (no
fused `alpha=` forms), to match the rest of dilocod.

`update` must be given the same split the wire used: `roundtrip` encodes each tensor on its own
(flattened), so its blocks never straddle two parameters. The all-reduce encodes butterfly parts of
131072 values cut from each tensor's start (`peers/allreduce.py`); that is a multiple of every
`Codec.alignment`, so part by part gives exactly what `roundtrip` gives (`tests/test_codecs.py` checks
it). If a round is dropped before anything was sent, skip `update`, and decide at the caller whether Δ
itself is kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dilocod.codecs.base import Codec


def roundtrip(codec: Codec, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """decode(encode(t)) for each tensor, flattened on its own and reshaped back (fp32, CPU)."""
    out = []
    for tensor in tensors:
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        out.append(codec.decode(codec.encode(flat), flat.numel()).view(tensor.shape))
    return out


class ErrorFeedback:
    """The residual of each parameter tensor (CPU, `dtype`), in the caller's parameter order."""

    def __init__(
        self,
        shapes: Sequence[torch.Size | Sequence[int]],
        dtype: torch.dtype = torch.float32,
        decay: float = 1.0,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0.0 < decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay!r}")
        self.residual = [torch.zeros(tuple(shape), dtype=dtype) for shape in shapes]
        self.decay = float(decay)

    def _carried(self, e: torch.Tensor) -> torch.Tensor:
        """β·e in fp32 (e itself when β = 1: the plain feedback's exact operations)."""
        return e if self.decay == 1.0 else torch.mul(e.to(torch.float32), self.decay)

    def compensate(self, delta: Sequence[torch.Tensor], *, in_place: bool = False) -> list[torch.Tensor]:
        """Δ + β·e: what to send this round. Fresh tensors, `delta` not modified; with `in_place`, e is added
        into `delta`'s own tensors (CPU fp32 ones the caller owns) and those are returned: a model's worth
        of memory less at a round's close."""
        self._check(delta, "delta")
        if in_place:
            if any(d.device.type != "cpu" or d.dtype != torch.float32 for d in delta):
                raise ValueError("compensate in place needs CPU fp32 tensors")
            return [d.add_(self._carried(e)) for d, e in zip(delta, self.residual)]
        return [
            torch.add(d.detach().to(device="cpu", dtype=torch.float32), self._carried(e))
            for d, e in zip(delta, self.residual)
        ]

    def uncompensated(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """sent − β·e, fresh fp32 CPU tensors: the round's own Δ in what `compensate` returned (before e
        changes). With a sparse codec e holds many rounds of work not yet sent, far larger than one Δ."""
        self._check(sent, "sent")
        return [
            torch.sub(s.detach().to(device="cpu", dtype=torch.float32), self._carried(e))
            for s, e in zip(sent, self.residual)
        ]

    @torch.no_grad()
    def update(self, sent: Sequence[torch.Tensor], transmitted: Sequence[torch.Tensor]) -> None:
        """e ← sent − transmitted. All shapes are checked before any residual changes."""
        self._check(sent, "sent")
        self._check(transmitted, "transmitted")
        for e, s, t in zip(self.residual, sent, transmitted):
            e.copy_(
                torch.sub(s.to(device="cpu", dtype=torch.float32), t.to(device="cpu", dtype=torch.float32))
            )

    @torch.no_grad()
    def settle(self, codec: Codec, sent: Sequence[torch.Tensor]) -> None:
        """`update(sent, roundtrip(codec, sent))`, one tensor at a time: the codec's output for the whole
        model is never held at once (one model's worth less at a round's end)."""
        self._check(sent, "sent")
        for e, s in zip(self.residual, sent):
            (transmitted,) = roundtrip(codec, [s])
            e.copy_(torch.sub(s.to(device="cpu", dtype=torch.float32), transmitted))

    def reset(self) -> None:
        """Forget the residual (e.g. after adopting θ_global from another peer)."""
        for e in self.residual:
            e.zero_()

    def norm(self) -> float:
        """‖e‖₂ over all tensors: a cheap health metric."""
        return math.sqrt(sum(float(torch.sum(torch.square(e.double()))) for e in self.residual))

    def state_dict(self) -> dict[str, Any]:
        return {"residual": [e.clone() for e in self.residual]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a saved residual; shapes must match this instance's (all-or-nothing)."""
        tensors = state.get("residual")
        if not isinstance(tensors, list | tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("error-feedback state must hold a list of tensors under 'residual'")
        self._check(tensors, "residual")
        for e, t in zip(self.residual, tensors):
            e.copy_(t)  # into this node's dtype, whichever the checkpoint was written with

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        if len(tensors) != len(self.residual):
            raise ValueError(f"expected {len(self.residual)} {what} tensors, got {len(tensors)}")
        for e, t in zip(self.residual, tensors):
            if t.shape != e.shape:
                raise ValueError(f"{what} shape mismatch: {tuple(t.shape)} vs {tuple(e.shape)}")
