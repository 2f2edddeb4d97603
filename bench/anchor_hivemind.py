"""The race against the anchor: the stock `hivemind.Optimizer` against dilocod, side by side in one run.

    .venv/bin/python bench/anchor_hivemind.py [--peers 3] [--seconds 120] [--threads 1]
        [--config configs/tiny.toml] [--set k=v ...] [--only hivemind|dilocod] [--eval-at-steps N]
        [--matchmaking-time S] [--averaging-timeout S] [--keep DIR] [--verbose] [--json]

Both sides train the same model on the same corpus, batches and data shards (peer i of each side has
the same identity key), with the same lr schedule and clipping (dilocod's `InnerTrainer`), the
same number of peers, `--threads` torch threads each, on this machine, for `--seconds` of wall time —
one side after the other, so they never compete for the cores:

- dilocod: a bootstrap and `--peers` real peers (`dilocod join`) with the config's settings (its inner
  optimizer too: Muon by default);
- hivemind: a DHT bootstrap and `--peers` workers whose optimizer step is `hivemind.Optimizer` with
  `use_local_updates=True` (local AdamW steps, parameters averaged at every global epoch; AdamW whatever
  the config says, as hivemind wraps only a `torch.optim.Optimizer`; `--set trainer.optimizer=adamw`
  gives both sides the same one),
  `target_batch_size` = the sequences of one dilocod round (H × batch × peers, or `round.tokens`),
  `matchmaking_time` and `averaging_timeout` = the config's `averaging.min_matchmaking_time` and
  `averaging.allreduce_timeout` (resolved when auto) unless given, and its `averaging.request_timeout`.

Per side: inner steps per peer, rounds (hivemind's epochs, dilocod's outer steps), rounds with all peers
in the group, and the eval loss (the run's eval batches) of the model a peer would publish — hivemind: the
parameters it holds; dilocod: θ_global — at equal wall time (the end) and at equal tokens (hivemind's
peers are also evaluated when they pass the dilocod side's mean step count, or `--eval-at-steps`; if they
never do, the comparison is made at hivemind's final step count instead, against θ_global's eval at the
last outer step dilocod's peers reached within that many steps, from their rounds' records).
Every process (DHTs, averagers, p2pd) is reaped on exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anchor.dilocod_side import run_dilocod  # noqa: E402
from bench.anchor.hivemind_side import run_hivemind  # noqa: E402
from bench.anchor.report import dilocod_at_steps, dilocod_summary, hivemind_summary, spread, table  # noqa: E402
from bench.anchor.settings import HIVEMIND_OPTIMIZER, REPO, Race, identities, round_samples  # noqa: E402
from dilocod.node.autodeadlines import resolve_deadlines  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--seconds", type=float, default=120.0, help="wall seconds of training per side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.toml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--only", choices=("hivemind", "dilocod"), default=None, help="run one side")
    p.add_argument("--eval-at-steps", type=int, default=None, help="hivemind's equal-tokens step count")
    p.add_argument("--matchmaking-time", type=float, default=None, help="hivemind's (default: the config's)")
    p.add_argument("--averaging-timeout", type=float, default=None, help="hivemind's (default: the config's)")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directory (logs) here")
    p.add_argument("--verbose", action="store_true", help="hivemind's progress lines in the workers' logs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args()


def race_against_anchor(args: argparse.Namespace, race: Race, root: Path) -> dict[str, Any]:
    cfg = race.load()  # a bad --set fails here, before anything starts
    paths, keys = identities(root, race.peers)
    target = round_samples(cfg, race.peers)
    result: dict[str, Any] = {
        "peers": race.peers,
        "seconds": race.seconds,
        "threads": race.threads,
        "config": str(race.config),
        "overrides": list(race.sets),
        "target_batch_size": target,
    }
    eval_at = args.eval_at_steps
    statuses: list[dict[str, Any]] = []
    if args.only != "hivemind":  # first: its mean step count is hivemind's equal-tokens point
        statuses, before = run_dilocod(race, paths, root)
        result["dilocod"] = dilocod_summary(statuses, before, race.peers)
        result["dilocod"]["optimizer"] = cfg.trainer.optimizer
        eval_at = eval_at or result["dilocod"]["equal_tokens_steps"]
    if args.only != "dilocod":
        matchmaking = args.matchmaking_time or cfg.averaging.min_matchmaking_time
        timeout = args.averaging_timeout or resolve_deadlines(cfg)[0].averaging.allreduce_timeout
        results = run_hivemind(
            race,
            keys,
            root,
            eval_at_steps=eval_at,
            matchmaking_time=matchmaking,
            averaging_timeout=timeout,
            request_timeout=cfg.averaging.request_timeout,
            target_batch_size=target,
            verbose=args.verbose,
        )
        result["hivemind"] = hivemind_summary(results, race.peers)
        result["hivemind"].update(
            matchmaking_time=matchmaking, averaging_timeout=timeout, optimizer=HIVEMIND_OPTIMIZER
        )
        if "dilocod" in result and not result["hivemind"]["equal_tokens_reached"]:
            equal_tokens_the_other_way(result, statuses, cfg.trainer.batch_size * cfg.trainer.seq_len)
    return result


def equal_tokens_the_other_way(
    result: dict[str, Any], statuses: list[dict[str, Any]], step_tokens: int
) -> None:
    """hivemind's peers never reached dilocod's step count: compare at hivemind's instead, its end against
    the θ_global dilocod's peers had when they had trained no more (from their rounds' records)."""
    hivemind = result["hivemind"]
    at = dilocod_at_steps(statuses, hivemind["steps_per_peer"], step_tokens)
    if at is None:
        return
    hivemind.update(
        eval_equal_tokens=hivemind["eval_equal_time"], equal_tokens_steps=hivemind["steps_per_peer"]
    )
    result["dilocod"].update(
        eval_equal_tokens=spread([at["eval_loss"]]),
        equal_tokens_steps=at["steps"],
        equal_tokens_outer_step=at["outer_step"],
    )


def main() -> None:
    args = parse_args()
    race = Race(args.peers, args.seconds, args.threads, args.config.resolve(), tuple(args.sets))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # reap every process through `finally`
    with tempfile.TemporaryDirectory(prefix="dilocod-anchor-") as tmp:
        result = race_against_anchor(args, race, args.keep.resolve() if args.keep else Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{race.peers} peers, {race.seconds:.0f}s, {race.threads} thread(s) each, {race.config.name} "
        f"{' '.join(race.sets)}; hivemind target_batch_size {result['target_batch_size']}"
    )
    print(table(result))


if __name__ == "__main__":
    main()
