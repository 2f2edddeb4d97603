"""What contribution scores look like: one peer trains H steps a round on a chunk's windows (honest), the same
H steps on 64 fixed windows (wrong_data), tiny noise (freeride) and the previous round's update (copy_update),
and each Δ is scored as a scorer would (dilocod/trust/measure.py, dilocod/trust/scoring.py); θ_global then
moves by the honest Δ.

    .venv/bin/python bench/score_calibration.py [H] [sequences] [step] [rounds]
"""

from __future__ import annotations

import sys

import torch

from dilocod.config import load_config
from dilocod.data.cursor import part_windows
from dilocod.trainer.data import batch_at
from dilocod.trainer.inner import InnerTrainer
from dilocod.trust.measure import measure, pick, random_starts
from dilocod.trust.scoring import score

CHUNK = 8192
BATCH = 8


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


def main() -> None:
    args = [*sys.argv[1:], "", "", "", ""]
    h, n = int(args[0] or 5), int(args[1] or 16)
    step, rounds = float(args[2] or 1.0), int(args[3] or 16)
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.toml", [f"trainer.batch_size={BATCH}", "trainer.seq_len=64",
                                            "trainer.warmup_steps=5", "trainer.threads=1"])  # fmt: skip
    trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="a")
    scorer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="s", corpus=trainer.corpus).model
    source, seq_len, total = trainer.train_source, cfg.trainer.seq_len, trainer.train_tokens
    theta = [p.detach().clone() for p in trainer.params()]
    previous: list[torch.Tensor] | None = None
    chunk = 3
    for r in range(rounds):
        taken = part_windows("ds", (0, chunk, 0, CHUNK), CHUNK, total, seq_len)[: h * BATCH]
        honest = trained(trainer, theta, taken, h)
        wrong = trained(trainer, theta, [i * seq_len for i in range(64)], h)
        trainer.load_params(theta)
        size = norm(honest)
        noise = [torch.randn_like(d) for d in honest]
        cases = {"honest": honest, "wrong_data": wrong,
                 "freeride": [x * 1e-3 * size / norm(noise) for x in noise]}  # fmt: skip
        if previous is not None:
            cases["copy_update"] = [d * size / norm(previous) for d in previous]
        claimed = batch_at(source, pick(taken, n, f"c{r}"), seq_len)
        rand = batch_at(source, random_starts(total, seq_len, n, f"r{r}"), seq_len)
        line = []
        for name, delta in cases.items():
            s = score(measure(scorer, theta, delta, None, claimed, rand, step))
            line.append(
                f"{name} gain {s.gain:+.4f} beyond {s.data_gain:+.4f} {'pass' if s.passed else 'FAIL'}"
            )
        print(r, " | ".join(line), flush=True)
        theta = [t - d for t, d in zip(theta, honest)]
        previous = honest
        chunk = (chunk * 7 + 101) % 1300


if __name__ == "__main__":
    main()
