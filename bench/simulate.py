"""DiLoCo against data parallel, M replicas in one process: eval loss at equal tokens, with error bars.

    .venv/bin/python bench/simulate.py [--replicas 2,4] [--inner-steps 10,50] [--tokens 200000]
        [--seeds K] [--seed S] [--preset tiny] [--config FILE] [--set section.key=value ...]
        [--outer-lr 0.7,...] [--momentum 0.9] [--optimizer adamw,muon] [--compression none,int4,...]
        [--overlap none,delayed,streaming] [--fragments F] [--speeds 1,1,0.5,...]
        [--identities DIR,DIR,...] [--horizon budget|config] [--eval-batches N] [--dp] [--overhead] [--json]

Each replica is what a peer runs, built from the daemon's own parts and nothing else: the model and the
data shard of its identity (`InnerTrainer`: inner optimizer, lr schedule, warmup, grad clipping), its
θ_global and outer momentum (`OuterOptimizer`), the round pipeline of the overlap mode (`RoundPipeline`:
pseudo-gradients, error feedback, streaming fragments, the delayed outer step), and the token ledger
(`TokenLedger`). The group's all-reduce runs in-process with the daemon's weights (the tokens behind each
contribution, capped as `peers/membership.py` caps them), hivemind's split into parts, the codec's
payloads and the run's reducer (`dilocod/aggregation`). So a variant here is the daemon's algorithm, and
two real peers with the same seed, identities and steps per round end with the same θ_global bits
(`tests/test_simulate.py`).

Options (a comma list runs one variant per value, every combination of them):
  --replicas M        replicas (peers) training together (list)
  --inner-steps H     inner steps per round of a replica of average speed (list; default: the config's)
  --tokens N          tokens every variant trains, all replicas together (default 200000): each replica
                      takes S = N / (M × batch × seq_len) steps (rounded), the last round cut short
  --seeds K           run each variant for seeds S, S+1, …, S+K−1 (model init, shards, batches, eval set)
  --seed S            the first seed (default: the config's run.seed)
  --preset P          the model preset; the config file defaults to configs/P.toml (tiny: configs/tiny.toml)
  --config FILE       the daemon's config file (batch, seq_len, lr, warmup, outer lr, codec, reducer, …)
  --set k=v           any config key, as `dilocod join --set` takes it (e.g. averaging.reducer=mean,
                      trainer.threads=1, trainer.batch_size=8)
  --outer-lr, --momentum     the outer Nesterov step (outer.lr list, outer.momentum)
  --optimizer         adamw or muon: the inner optimizer (list), for DiLoCo and its dp baseline alike
  --compression       none, fp16, int8, int4, int2 or topk (list); int4, int2 and topk run with error feedback
  --overlap           none, delayed or streaming (list); --fragments F for streaming (outer.fragments)
  --speeds s1,…,sM    replica i trains s_i / mean(s) × the tokens of an average replica per round, as the
                      run's clock gives a peer of that speed; contributions are weighted by their tokens
  --identities D,…    real peers' run dirs (or their identity.key files): replica i takes the data shard
                      of peer i; default: fixed synthetic identities (shards may coincide, as real ones may)
  --horizon           budget (default): the cosine lr decay ends with the budget (trainer.total_steps = S);
                      config: the config's trainer.total_steps
  --eval-batches N    eval batches (trainer.eval_batches; default: the config's)
  --dp                run only the data-parallel baselines
  --overhead          also time one replica's trainer alone and print the simulator's speed against
                      M × that (stderr)
  --json              print a JSON list, one object per variant: variant, replicas, inner_steps (null for
                      dp), seeds, tokens, eval_loss_mean, eval_loss_sd (null for one seed), ratio_to_dp,
                      bytes_per_token_ratio, and eval_losses, outer_steps, train_seconds_mean (training
                      and rounds) and round_seconds_mean (of those, the rounds)

Every (M, inner optimizer) also runs its data-parallel baseline: one model on the M replicas' batches
concatenated (M× the batch), S steps, the same lr schedule, the same tokens. eval_loss is θ_global's (dp:
θ's) at the end on the run's held-out eval batches (those the daemon evaluates on), ratio_to_dp = the
variant's mean eval loss ÷ its baseline's. bytes_per_token_ratio = payload bytes a replica sends per
token it trains ÷ the baseline's, where a dp worker sends one fp32 gradient every step and a replica one
pseudo-gradient (its codec's payload size, a fragment with streaming) every round. Progress goes to
stderr, one line per run.

Modelled: everything above, deterministically for a seed (with the same threads: set trainer.threads).
Not modelled: the network and its failures (every replica is in every round, every round completes, no
re-syncs, no bans, no stragglers the clock leaves behind), wall-clock time (speeds set steps, not
seconds), the receivers' plausibility check of averages (it never fires between honest replicas), a
replica taking no step in a round shorter than one of its steps (a real peer takes at least one, and is
late), and the group's member order, which a real group draws per round: replicas are in identity order.
The `mean` and `centered_clip` reducers sum in member order, so another order can change the last bit of
an average; with two members `centered_clip` (the default) is symmetric, which is what lets
`tests/test_simulate.py` compare with two real peers bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.diloco import RunResult  # noqa: E402
from bench.sim.overhead import measure  # noqa: E402
from bench.sim.report import Outcome, rows, table  # noqa: E402
from bench.sim.settings import SimOptions, base_seed  # noqa: E402
from bench.sim.variants import Choices, Runner, Variant, expand, name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def _list(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/simulate.py", description="DiLoCo vs data parallel, M replicas in one process"
    )
    p.add_argument("--replicas", type=_list(int), default=[2])
    p.add_argument("--inner-steps", type=_list(int), default=[None])
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--preset", default=None)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--outer-lr", type=_list(float), default=[None])
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--optimizer", type=_list(str), default=[None])
    p.add_argument("--compression", type=_list(str), default=[None])
    p.add_argument("--overlap", type=_list(str), default=[None])
    p.add_argument("--fragments", type=int, default=None)
    p.add_argument("--speeds", type=_list(float), default=None)
    p.add_argument("--identities", type=_list(Path), default=None)
    p.add_argument("--horizon", default="budget", choices=("budget", "config"))
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--dp", action="store_true", help="run only the data-parallel baselines")
    p.add_argument("--overhead", action="store_true", help="time one replica's trainer alone too")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def options_from(args: argparse.Namespace) -> SimOptions:
    sets = list(args.sets)
    if args.preset is not None:
        sets.insert(0, f"model.preset={args.preset}")
    if args.eval_batches is not None:
        sets.append(f"trainer.eval_batches={args.eval_batches}")
    config = args.config
    if config is None:
        config = REPO / "configs" / f"{args.preset or 'tiny'}.toml"
        config = config if config.is_file() else None
    speeds = tuple(args.speeds) if args.speeds is not None else None
    if speeds is not None and len(args.replicas) != 1:
        raise ValueError("--speeds needs a single --replicas value")
    identities = tuple(args.identities) if args.identities is not None else None
    return SimOptions(
        config, tuple(sets), args.tokens, args.seeds, args.seed, speeds, identities, args.horizon
    )


def choices_from(args: argparse.Namespace) -> Choices:
    return Choices(
        replicas=args.replicas,
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        compression=args.compression,
        overlap=args.overlap,
        optimizer=args.optimizer,
        momentum=args.momentum,
        fragments=args.fragments,
        dp_only=args.dp,
    )


def run_all(
    runner: Runner, variants: Sequence[Variant], seeds: Sequence[int]
) -> dict[Variant, list[RunResult]]:
    """Every variant for every seed, seed by seed (so an interrupted study has whole seeds)."""
    results: dict[Variant, list[RunResult]] = {v: [] for v in variants}
    for seed in seeds:
        for variant in variants:
            result = runner.run(variant, seed)
            results[variant].append(result)
            label = name(variant, runner.config(variant, seed), runner.options.speeds)
            print(
                f"seed {seed} M={variant.replicas} {label}: eval {result.eval_loss:.4f}, "
                f"{result.tokens} tokens, {result.train_seconds:.1f}s ({result.round_seconds:.1f}s in rounds)",
                file=sys.stderr,
                flush=True,
            )
    return results


def outcomes(runner: Runner, results: dict[Variant, list[RunResult]], seed: int) -> list[Outcome]:
    found = []
    for variant, runs in results.items():
        cfg = runner.config(variant, seed)
        h = None if variant.dp else cfg.trainer.inner_steps
        found.append(Outcome(variant, name(variant, cfg, runner.options.speeds), h, runs))
    return found


def report_overhead(runner: Runner, results: dict[Variant, list[RunResult]], seed: int) -> None:
    variant = next((v for v in results if not v.dp), None)
    if variant is None:
        return
    overhead = measure(runner, variant, seed, results[variant][0])
    print(
        f"overhead: M={variant.replicas} {name(variant, runner.config(variant, seed), runner.options.speeds)}: "
        f"{overhead.simulator_seconds_per_step:.4f}s per replica step (rounds included) vs "
        f"{overhead.bare_seconds_per_step:.4f}s for one trainer alone: {overhead.ratio:.3f} × M × bare",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # every setting is checked before the first run: a typo costs no hour of training
        runner = Runner(options_from(args))
        variants = expand(choices_from(args))
        first = base_seed(runner.options)
        for variant in variants:
            runner.check(variant, first)
    except ValueError as e:  # ConfigError included
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2
    results = run_all(runner, variants, range(first, first + runner.options.seeds))
    if args.overhead:
        report_overhead(runner, results, first)
    data = rows(outcomes(runner, results, first))
    print(json.dumps(data, indent=1) if args.json else table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
