"""What contribution scores look like, as a scorer computes them (dilocod/trust/measure.py,
dilocod/trust/scoring.py, the thresholds of dilocod/node/scorer.py). Every round, from one θ_global:

- the scorer's own Δ (the reference): H inner steps on the windows of one chunk;
- `honest`: a contributor's Δ, `--honest-steps` inner steps (H unless given: fewer is a slower peer) on
  the windows of another chunk, the one its ticket claims;
- `wrong_data`: H steps on the same 64 windows at the start of the stream, claiming that chunk too;
- `freeride`: tiny noise (10⁻³ of the honest Δ's norm);
- `copy_update`: the run's last outer update, rescaled to the honest Δ's norm.

Each is scored on `--sequences` windows of the claimed chunk; θ_global then moves by the reference Δ. The
last lines count the passes of each case.

    .venv/bin/python bench/score_calibration.py [--steps 20] [--honest-steps N] [--rounds 12]
        [--sequences 8] [--batch 8] [--seq-len 64] [--chunk-tokens 8192] [--no-reference]
"""

from __future__ import annotations

import argparse

import torch

from dilocod.config import load_config
from dilocod.data.cursor import part_windows
from dilocod.node.scorer import MIN_DATA_GAIN_MEASURED
from dilocod.trainer.batches import batch_at
from dilocod.trainer.inner import InnerTrainer
from dilocod.trust.measure import measure, pick, random_starts
from dilocod.trust.scoring import MIN_GAIN, score


class Windows:
    """A cursor that hands out a fixed list of window starts."""

    def __init__(self, starts: list[int]) -> None:
        self.starts = starts

    def windows(self, n: int) -> list[int]:
        taken, self.starts = self.starts[:n], self.starts[n:] + self.starts[:n]
        return taken


def norm(ts: list[torch.Tensor]) -> float:
    return float(sum(float((t**2).sum()) for t in ts)) ** 0.5


def trained(
    trainer: InnerTrainer, theta: list[torch.Tensor], starts: list[int], h: int
) -> list[torch.Tensor]:
    trainer.load_params(theta)
    trainer.cursor = Windows(starts)  # type: ignore[assignment]
    trainer.train_steps(h)
    return [t - w for t, w in zip(theta, trainer.working_params_fp32())]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="H: the scorer's (and wrong_data's) inner steps")
    ap.add_argument("--honest-steps", type=int, default=0, help="the honest contributor's steps (0: H)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sequences", type=int, default=8, help="claimed (and random) windows per score")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--no-reference", action="store_true", help="score against random text only")
    return ap.parse_args()


def main() -> None:
    a = parse()
    h, honest_steps = a.steps, a.honest_steps or a.steps
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.toml", [f"trainer.batch_size={a.batch}", f"trainer.seq_len={a.seq_len}",
                                            "trainer.warmup_steps=5", "trainer.threads=1"])  # fmt: skip
    trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="a")
    # One trainer per peer: each keeps its own inner optimizer's state from round to round, as a peer does.
    peers = {name: InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key=name, corpus=trainer.corpus)
             for name in ("scorer", "honest", "wrong_data")}  # fmt: skip
    scorer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="s", corpus=trainer.corpus).model
    source, seq_len, total = trainer.train_source, a.seq_len, trainer.train_tokens

    chunks = max(1, total // a.chunk_tokens)
    theta = [p.detach().clone() for p in peers["scorer"].params()]
    previous: list[torch.Tensor] | None = None
    mine, theirs = 700, 3
    passes: dict[str, list[bool]] = {}
    margins: dict[str, list[float]] = {}

    def windows(chunk: int, steps: int) -> list[int]:
        part = (0, chunk % chunks, 0, a.chunk_tokens)
        return part_windows("ds", part, a.chunk_tokens, total, seq_len)[: steps * a.batch]

    for r in range(a.rounds):
        taken = windows(theirs, honest_steps)
        reference = trained(peers["scorer"], theta, windows(mine, h), h)
        honest = trained(peers["honest"], theta, taken, honest_steps)
        wrong = trained(peers["wrong_data"], theta, [i * seq_len for i in range(64)], h)
        size = norm(honest)
        noise = [torch.randn_like(d) for d in honest]
        cases = {"honest": honest, "wrong_data": wrong,
                 "freeride": [x * 1e-3 * size / norm(noise) for x in noise]}  # fmt: skip
        if previous is not None:
            cases["copy_update"] = [d * size / norm(previous) for d in previous]
        claimed = batch_at(source, pick(taken, a.sequences, f"c{r}"), seq_len)
        rand = batch_at(source, random_starts(total, seq_len, a.sequences, f"r{r}"), seq_len)
        line = []
        for name, delta in cases.items():
            ref = None if a.no_reference else reference
            s = score(measure(scorer, theta, delta, None, claimed, rand if ref is None else None, 1.0, ref),
                      MIN_GAIN, MIN_DATA_GAIN_MEASURED)  # fmt: skip
            passes.setdefault(name, []).append(s.passed)
            margin = s.reference_margin if s.reference_margin is not None else s.data_gain or 0.0
            margins.setdefault(name, []).append(margin)
            line.append(f"{name} gain {s.gain:+.4f} margin {margin:+.4f} {'pass' if s.passed else 'FAIL'}")
        print(r, " | ".join(line), flush=True)
        previous = reference  # the run's outer update of this round (outer lr 1, no momentum)
        theta = [t - d for t, d in zip(theta, reference)]
        mine, theirs = (mine * 11 + 37) % 1300, (theirs * 7 + 101) % 1300
    for name, got in passes.items():
        low, high = min(margins[name]), max(margins[name])
        print(f"{name}: passed {sum(got)} of {len(got)} (margins {low:+.3f} to {high:+.3f})", flush=True)


if __name__ == "__main__":
    main()
