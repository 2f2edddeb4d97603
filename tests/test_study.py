"""The study driver: which units are left, what each cell is compared with, the report of finished units."""

from __future__ import annotations

import json
from pathlib import Path

from bench.study import DEFAULTS, Cell, baseline_of, cells, pending, report, report_per_seed, unit_path
from dilocod.config import load_config

REPO = Path(__file__).resolve().parent.parent


def _write(out: Path, cell: Cell, seed: int, loss: float, bytes_sent: int) -> None:
    path = unit_path(out, cell, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    unit = {
        "variant": cell.name,
        "tokens": 1000,
        "eval_loss": loss,
        "bytes_sent": bytes_sent,
        "outer_steps": 3,
    }
    path.write_text(json.dumps(unit))


def test_every_diloco_cell_has_the_baseline_of_its_m_optimizer_and_budget() -> None:
    every = cells()
    for cell in every:
        if cell.dp:
            continue
        base = baseline_of(cell, every)
        assert base is not None, cell.name
        assert (base.replicas, base.tokens, base.optimizer) == (cell.replicas, cell.tokens, cell.optimizer)
    muon = next(c for c in every if c.name == "m4-h50-muon")
    assert baseline_of(muon, every) == next(c for c in every if c.name == "m4-dp-muon")


def test_pending_runs_first_seeds_first_and_skips_finished_units(tmp_path: Path) -> None:
    every = cells()
    todo = list(pending(tmp_path, every, ["m4-"]))
    first_second = next(i for i, (_, seed) in enumerate(todo) if seed == 1)
    assert all(seed == 0 for _, seed in todo[:first_second])
    assert all(cell.name.startswith("m4-") for cell, _ in todo)
    done_cell, done_seed = todo[0]
    _write(tmp_path, done_cell, done_seed, 2.0, 10)
    assert (done_cell, done_seed) not in list(pending(tmp_path, every, ["m4-"]))
    assert len(list(pending(tmp_path, every, ["m4-"]))) == len(todo) - 1


def test_report_pairs_each_seed_with_its_baseline(tmp_path: Path) -> None:
    every = {c.name: c for c in cells()}
    _write(tmp_path, every["m4-dp"], 0, 2.0, 4000)
    _write(tmp_path, every["m4-dp"], 1, 2.2, 4000)
    _write(tmp_path, every["m4-h50"], 0, 2.02, 2)
    _write(tmp_path, every["m4-h50"], 1, 2.244, 2)
    text = report(tmp_path, 1.0)
    row = next(line for line in text.splitlines() if line.startswith("| m4-h50 |"))
    assert "1.0150 ± 0.0071" in row  # ratios 1.01 and 1.02
    assert "1/2,000" in row
    assert "m4-h10" not in text  # nothing finished


def test_per_seed_report_shows_each_seeds_ratio_and_what_is_missing(tmp_path: Path) -> None:
    every = {c.name: c for c in cells()}
    _write(tmp_path, every["m4-dp"], 0, 2.0, 4000)
    _write(tmp_path, every["m4-dp"], 1, 2.2, 4000)
    _write(tmp_path, every["m4-h50"], 0, 2.02, 2)
    _write(tmp_path, every["m4-h10"], 1, 2.31, 20)  # its seed 0 not finished
    text = report_per_seed(tmp_path, 1.0)
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| m4-h50"] == "| m4-h50 | 1.0100 | - | - | 1/2,000 |"
    assert rows["| m4-h10"] == "| m4-h10 | - | 1.0500 | - | 1/200 |"
    assert "| m4-dp" not in rows  # a baseline has no ratio of its own


def test_the_defaults_cell_is_what_configs_tiny_toml_sets() -> None:
    cfg = load_config(REPO / "configs" / "tiny.toml", ())
    shipped = {
        "trainer.inner_steps": str(cfg.trainer.inner_steps),
        "trainer.optimizer": cfg.trainer.optimizer,
        "averaging.compression": cfg.averaging.compression,
    }
    assert dict(o.split("=", 1) for o in DEFAULTS) == shipped
