"""The convergence study of docs/benchmarks.md ("Convergence: the study"), cell by cell and seed by seed.

    .venv/bin/python bench/study.py list                       # the cells, in the order they run
    nice -n 19 .venv/bin/python bench/study.py run [--jobs 2] [--only m4-,10m-] [--out DIR]
    .venv/bin/python bench/study.py report [--out DIR]         # the markdown table of what has finished

A cell is one simulator variant (`bench/simulate.py`'s machinery: the daemon's own trainer, outer step,
round pipeline, codecs and reducer, M replicas in one process) at one token budget; a unit is a cell
for one seed. Every unit runs in its own process (one trainer thread each, so two jobs use two cores and
a unit's numbers do not depend on what runs beside it) and writes `DIR/<cell>/seed-<S>.json` when it
finishes, so the study can be stopped and started again at any point and loses at most the units in
flight. Each DiLoCo cell is compared with the dp baseline of its M, inner optimizer and budget on the
seeds both have (a seed fixes the model init, the shards, the batches and the eval set of both).

The cells are issue 16's: dp against DiLoCo M ∈ {2, 4, 8} × H ∈ {10, 50, 200} at 5 M tokens (2 seeds)
with the default outer step (the plain average: lr 1, no momentum), at M = 4 also H = 20 (configs/tiny.toml's
default) and H = 5; at M = 4 the same H with DiLoCo's published step (`-nag`: lr 0.7, Nesterov momentum
0.9, the default before this study) and, at H = 50, its outer lr 0.4 and 1.0; at M = 4, H = 50: Muon (against a Muon dp), int8/int4/int2 with error
feedback, streaming and delayed overlap, replica speeds 1, 1, 1/1.5, 1/3 with token weights; configs/tiny.toml's
defaults together (H = 20, Muon, int4); and the headline M = 4 cells (dp, H = 50, H = 10) at 10 M tokens with
3 seeds (dp and H = 50 have a third seed at 5 M too, to pair the budgets seed by seed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "study"
# eval on 32 × 16 × 128 held-out tokens; fp32 parts unless a cell sets a codec, AdamW unless it sets Muon (the
# study measures them; both defaults changed on its results, and the cells must stay comparable)
SETS = (
    "trainer.threads=1",
    "trainer.eval_batches=32",
    "averaging.compression=none",
    "trainer.optimizer=adamw",
)


@dataclass(frozen=True)
class Cell:
    name: str
    tokens: int
    replicas: int
    seeds: tuple[int, ...]
    dp: bool = False
    overrides: tuple[str, ...] = ()  # section.key=value on top of configs/tiny.toml
    speeds: tuple[float, ...] | None = None

    @property
    def optimizer(self) -> str:
        found = [o.split("=", 1)[1] for o in self.overrides if o.startswith("trainer.optimizer=")]
        return found[0] if found else "adamw"


DEFAULTS = ("trainer.inner_steps=20", "trainer.optimizer=muon", "averaging.compression=int4")


def cells(scale: float = 1.0) -> list[Cell]:
    """Every cell, in the order they run: what sets the defaults first (budgets × scale: a quick look)."""
    two, three = (0, 1), (0, 1, 2)
    m4, m10 = round(5_000_000 * scale), round(10_000_000 * scale)
    # dp and H = 50 at M = 4 have the 10 M cells' three seeds, so that both budgets pair seed by seed
    found = [Cell("m4-dp", m4, 4, three, dp=True)]
    # the default outer step (configs/tiny.toml: lr 1, no momentum, the replicas' plain average)
    # H = 20 is configs/tiny.toml's default and H = 5 shows how the gap closes with more frequent rounds
    found += [
        Cell(f"m4-h{h}", m4, 4, three if h == 50 else two, overrides=(f"trainer.inner_steps={h}",))
        for h in (10, 50, 200, 20, 5)
    ]
    h50 = ("trainer.inner_steps=50",)
    nag = ("outer.lr=0.7", "outer.momentum=0.9")  # DiLoCo's published step (the default before this study)
    found += [
        Cell(f"m4-h{h}-nag", m4, 4, two, overrides=(f"trainer.inner_steps={h}", *nag)) for h in (10, 50, 200)
    ]
    found += [
        Cell("m4-h50-nag-lr0.4", m4, 4, two, overrides=(*h50, "outer.lr=0.4", "outer.momentum=0.9")),
        Cell("m4-h50-nag-lr1.0", m4, 4, two, overrides=(*h50, "outer.lr=1.0", "outer.momentum=0.9")),
        Cell("m4-h50-int8", m4, 4, two, overrides=(*h50, "averaging.compression=int8")),
        Cell("m4-h50-int4", m4, 4, two, overrides=(*h50, "averaging.compression=int4")),
        Cell("m4-h50-int2", m4, 4, two, overrides=(*h50, "averaging.compression=int2")),
        Cell("m4-h50-delayed", m4, 4, two, overrides=(*h50, "outer.overlap=delayed")),
        Cell("m4-h50-streaming", m4, 4, two, overrides=(*h50, "outer.overlap=streaming")),
        Cell("m4-h50-speeds", m4, 4, two, overrides=h50, speeds=(1.0, 1.0, 1 / 1.5, 1 / 3)),
        Cell("m4-dp-muon", m4, 4, two, dp=True, overrides=("trainer.optimizer=muon",)),
        Cell("m4-h50-muon", m4, 4, two, overrides=(*h50, "trainer.optimizer=muon")),
        # configs/tiny.toml's defaults together: H = 20, Muon, int4 parts (against dp with Muon)
        Cell("m4-h20-muon-int4", m4, 4, two, overrides=DEFAULTS),
    ]
    # the adaptive outer steps (Reddi et al. 2021): FedAdam at three learning rates and β1 0 / 0.9, FedYogi
    fedadam = (*h50, "outer.optimizer=fedadam")
    found += [
        Cell(f"m4-h50-fedadam-lr{lr}", m4, 4, two, overrides=(*fedadam, f"outer.lr={lr}"))
        for lr in ("1e-3", "3e-3", "1e-2")
    ]
    found += [
        Cell(f"m4-h10-fedadam-lr{lr}", m4, 4, two, overrides=(
            "trainer.inner_steps=10", "outer.optimizer=fedadam", f"outer.lr={lr}"))
        for lr in ("3e-3", "1e-2")
    ]  # fmt: skip
    found += [
        Cell("m4-h50-fedadam-b0.9", m4, 4, two, overrides=(*fedadam, "outer.lr=1e-3", "outer.momentum=0.9")),
        Cell("m4-h50-fedyogi", m4, 4, two, overrides=(*h50, "outer.optimizer=fedyogi", "outer.lr=1e-3")),
    ]
    found += topk_cells(m4, two)
    for m in (2, 8):
        found.append(Cell(f"m{m}-dp", m4, m, two, dp=True))
        found += [
            Cell(f"m{m}-h{h}", m4, m, two, overrides=(f"trainer.inner_steps={h}",)) for h in (10, 50, 200)
        ]
    found += [
        Cell("10m-m4-dp", m10, 4, three, dp=True),
        Cell("10m-m4-h50", m10, 4, three, overrides=h50),
        Cell("10m-m4-h10", m10, 4, three, overrides=("trainer.inner_steps=10",)),
    ]
    return found


def topk_cells(tokens: int, seeds: tuple[int, ...]) -> list[Cell]:
    """Sparse pseudo-gradients (`averaging.compression=topk`: error feedback with decay 0.95, the plain step)
    at M = 4: density 0.78, 1.56 (the default) and 3.1 % × H 10, 20, 50, each against dense int4 at its H;
    at H = 50 the error feedback's decay, 4-bit values and the outer step; 1.56 % at M = 2 and 8. A cell
    without `lr` in its name takes lr 1 (what the quick look measured them with: the default is now 3)."""
    topk = "averaging.compression=topk", "outer.lr=1"
    found = [
        Cell(
            f"m4-h{h}-int4",
            tokens,
            4,
            seeds,
            overrides=(f"trainer.inner_steps={h}", "averaging.compression=int4"),
        )
        for h in (10, 20)
    ]  # H = 50's is m4-h50-int4
    densities = {"": None, "-d0.78": "0.0078125", "-d3.1": "0.03125"}
    found += [
        Cell(f"m4-h{h}-topk{tag}", tokens, 4, seeds, overrides=(
            f"trainer.inner_steps={h}", *topk, *((f"averaging.topk_density={d}",) if d else ())))
        for h in (50, 10, 20)
        for tag, d in densities.items()
    ]  # fmt: skip
    h50 = ("trainer.inner_steps=50", *topk)
    found += [
        Cell("m4-h50-topk-ef0.9", tokens, 4, seeds, overrides=(*h50, "averaging.ef_decay=0.9")),
        Cell("m4-h50-topk-ef0.99", tokens, 4, seeds, overrides=(*h50, "averaging.ef_decay=0.99")),
        Cell("m4-h50-topk-4bit", tokens, 4, seeds, overrides=(*h50, "averaging.topk_value_bits=4")),
        Cell("m4-h50-topk-nag", tokens, 4, seeds, overrides=(*h50, "outer.lr=0.7", "outer.momentum=0.9")),
        Cell(
            "m4-h50-topk-fedadam", tokens, 4, seeds, overrides=(*h50, "outer.lr=0", "outer.optimizer=fedadam")
        ),
    ]
    found += [Cell(f"m{m}-h50-topk", tokens, m, seeds, overrides=h50) for m in (2, 8)]
    # at H = 10, where the quick look has 13 outer steps: a larger plain step (the sparse mean divides a
    # coordinate only one member sent by all M), the published Nesterov step, a slower decay, 4-bit values
    h10 = ("trainer.inner_steps=10", *topk)
    found += [
        *(
            Cell(f"m4-h10-topk-lr{lr}", tokens, 4, seeds, overrides=(*h10, f"outer.lr={lr}"))
            for lr in (2, 3, 4)
        ),
        Cell("m4-h10-topk-nag", tokens, 4, seeds, overrides=(*h10, "outer.lr=0.7", "outer.momentum=0.9")),
        Cell("m4-h10-topk-ef0.99", tokens, 4, seeds, overrides=(*h10, "averaging.ef_decay=0.99")),
        Cell("m4-h10-topk-4bit", tokens, 4, seeds, overrides=(*h10, "averaging.topk_value_bits=4")),
    ]
    # the plain step's rate by group size (the shrinkage grows with M), and lr 3 at H = 20 and 50
    found += [
        Cell(f"m{m}-h10-topk-lr{lr}", tokens, m, seeds, overrides=(*h10, f"outer.lr={lr}"))
        for m, rates in ((2, (1, 2, 3)), (8, (2, 3, 5)))
        for lr in rates
    ]
    found += [
        Cell(
            f"m4-h{h}-topk-lr3", tokens, 4, seeds, overrides=(f"trainer.inner_steps={h}", *topk, "outer.lr=3")
        )
        for h in (20, 50)
    ]
    return found


def baseline_of(cell: Cell, every: Sequence[Cell]) -> Cell | None:
    return next(
        (
            c
            for c in every
            if c.dp
            and c.replicas == cell.replicas
            and c.tokens == cell.tokens
            and c.optimizer == cell.optimizer
        ),
        None,
    )


def unit_path(out: Path, cell: Cell, seed: int) -> Path:
    return out / cell.name / f"seed-{seed}.json"


def run_unit(cell: Cell, seed: int, out: Path) -> None:
    """Train one cell for one seed in this process and write its result file (atomically)."""
    from bench.sim.settings import SimOptions
    from bench.sim.variants import Runner, Variant, name

    options = SimOptions(
        REPO / "configs" / "tiny.toml", (*SETS, *cell.overrides), cell.tokens, 1, seed, cell.speeds
    )
    runner = Runner(options)
    variant = Variant(dp=cell.dp, replicas=cell.replicas)
    result = runner.run(variant, seed)
    record = {
        "cell": cell.name,
        "seed": seed,
        "variant": name(variant, runner.config(variant, seed), cell.speeds),
        "replicas": cell.replicas,
        "budget": cell.tokens,
        "tokens": result.tokens,
        "eval_loss": result.eval_loss,
        "bytes_sent": result.bytes_sent,
        "outer_steps": len(result.rounds),
        "train_seconds": result.train_seconds,
        "round_seconds": result.round_seconds,
        "commit": _commit(),
    }
    path = unit_path(out, cell, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def pending(out: Path, every: Sequence[Cell], only: Sequence[str]) -> Iterator[tuple[Cell, int]]:
    """Units not yet on disk: the first seed of every cell before the second of any (whole comparisons early)."""
    chosen = [c for c in every if not only or any(c.name.startswith(p) for p in only)]
    for index in range(max(len(c.seeds) for c in chosen)):
        for cell in chosen:
            if index < len(cell.seeds) and not unit_path(out, cell, cell.seeds[index]).exists():
                yield cell, cell.seeds[index]


def run_pending(out: Path, jobs: int, only: Sequence[str], scale: float) -> int:
    todo = list(pending(out, cells(scale), only))
    print(f"study: {len(todo)} units to run, {jobs} at a time, results in {out}", file=sys.stderr, flush=True)

    def one(unit: tuple[Cell, int]) -> int:
        cell, seed = unit
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "unit",
                cell.name,
                str(seed),
                "--out",
                str(out),
                "--scale",
                str(scale),
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        print(
            f"study: {cell.name} seed {seed}: {'done' if done.returncode == 0 else f'FAILED ({done.returncode})'}"
            f" in {time.monotonic() - started:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        return done.returncode

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        codes = list(pool.map(one, todo))
    return 0 if all(code == 0 for code in codes) else 1


@dataclass(frozen=True)
class Unit:
    """What a finished unit's file says (the fields the report uses)."""

    variant: str
    tokens: int
    eval_loss: float
    bytes_sent: int
    outer_steps: int


def load(out: Path, cell: Cell) -> dict[int, Unit]:
    found = {}
    for seed in cell.seeds:
        path = unit_path(out, cell, seed)
        if path.exists():
            data = json.loads(path.read_text())
            found[seed] = Unit(
                str(data["variant"]),
                int(data["tokens"]),
                float(data["eval_loss"]),
                int(data["bytes_sent"]),
                int(data["outer_steps"]),
            )
    return found


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "-"
    sd = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.4f}{sd}"


def _per_token(units: dict[int, Unit], seeds: Sequence[int]) -> float:
    return sum(units[s].bytes_sent for s in seeds) / max(1, sum(units[s].tokens for s in seeds))


def _paired(
    out: Path, cell: Cell, every: Sequence[Cell]
) -> tuple[dict[int, Unit], dict[int, Unit], list[int]]:
    """A cell's finished units, its baseline's, and the seeds both have (no baseline for a dp cell)."""
    runs = load(out, cell)
    base = baseline_of(cell, every)
    base_runs = load(out, base) if base is not None and not cell.dp else {}
    return runs, base_runs, sorted(set(runs) & set(base_runs))


def _bytes_ratio(runs: dict[int, Unit], base_runs: dict[int, Unit], paired: Sequence[int]) -> str:
    if not paired:
        return "-"
    mine, theirs = _per_token(runs, paired), _per_token(base_runs, paired)
    return f"1/{theirs / mine:,.0f}" if mine else "0"


def report(out: Path, scale: float) -> str:
    """Markdown: each cell's eval loss over its seeds, and its per-seed ratio to its dp baseline."""
    every = cells(scale)
    lines = [
        "| cell | variant | M | tokens | seeds | outer steps | eval loss (mean ± sd) "
        "| ÷ dp, per seed (mean ± sd) | bytes/token vs dp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in every:
        runs, base_runs, paired = _paired(out, cell, every)
        if not runs:
            continue
        ratios = [runs[s].eval_loss / base_runs[s].eval_loss for s in paired]
        first = next(iter(runs.values()))
        losses = [r.eval_loss for r in runs.values()]
        lines.append(
            f"| {cell.name} | {first.variant} | {cell.replicas} | {first.tokens:,} | {len(runs)} "
            f"| {first.outer_steps} | {_mean_sd(losses)} | {_mean_sd(ratios)} "
            f"| {_bytes_ratio(runs, base_runs, paired)} |"
        )
    return "\n".join(lines)


def report_per_seed(out: Path, scale: float) -> str:
    """Markdown: every DiLoCo cell's ratio to its baseline, one column per seed (the spread made visible)."""
    every = cells(scale)
    most = max(len(c.seeds) for c in every)
    head = " | ".join(f"seed {s}" for s in range(most))
    lines = [f"| cell | {head} | bytes/token vs dp |", "|---|" + "---|" * (most + 1)]
    for cell in every:
        runs, base_runs, paired = _paired(out, cell, every)
        if cell.dp or not runs:
            continue
        cols = [
            f"{runs[s].eval_loss / base_runs[s].eval_loss:.4f}" if s in paired else "-" for s in range(most)
        ]
        lines.append(f"| {cell.name} | {' | '.join(cols)} | {_bytes_ratio(runs, base_runs, paired)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/study.py", description="the convergence study, resumable")
    p.add_argument("command", choices=("list", "run", "report", "unit"))
    p.add_argument("cell", nargs="?")
    p.add_argument("seed", nargs="?", type=int)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default="", help="comma list of cell-name prefixes")
    p.add_argument(
        "--scale", type=float, default=1.0, help="every budget × this (a quick look; use its own --out)"
    )
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if args.command == "list":
        for cell in cells(args.scale):
            sets = " ".join(cell.overrides)
            print(f"{cell.name:<20} M={cell.replicas} tokens={cell.tokens:,} seeds={list(cell.seeds)} {sets}")
        return 0
    if args.command == "report":
        print(report(args.out, args.scale))
        print()
        print(report_per_seed(args.out, args.scale))
        return 0
    if args.command == "unit":
        by_name = {c.name: c for c in cells(args.scale)}
        if args.cell not in by_name or args.seed is None:
            print(f"study: error: unit needs a cell ({', '.join(by_name)}) and a seed", file=sys.stderr)
            return 2
        run_unit(by_name[args.cell], args.seed, args.out)
        return 0
    return run_pending(args.out, max(1, args.jobs), only, args.scale)


if __name__ == "__main__":
    sys.exit(main())
