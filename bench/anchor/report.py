"""The race's figures per side, from the hivemind workers' results and the dilocod peers' statuses, and the
side-by-side table."""

from __future__ import annotations

import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, min and max (None when nothing was measured)."""
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {
        "mean": round(statistics.mean(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def hivemind_summary(results: list[dict[str, Any]], peers: int) -> dict[str, Any]:
    """Epochs are hivemind's rounds. Every member of a round sees it, so the rounds with all peers are the
    most any peer took part in with a group of every peer."""
    full = [sum(size == peers for size in r["groups"]) for r in results]
    at = [r["at_steps"]["eval_loss"] for r in results if r["at_steps"] is not None]
    return {
        "steps_per_peer": round(statistics.mean(r["steps"] for r in results), 1),
        "steps": [r["steps"] for r in results],
        "seconds": [r["seconds"] for r in results],
        "rounds": max(r["epoch"] for r in results),
        "rounds_averaged": [len(r["groups"]) for r in results],  # per peer, any group size
        "rounds_full": max(full),
        "rounds_full_per_peer": full,
        "eval_equal_time": spread([r["eval_loss"] for r in results]),
        "eval_equal_tokens": spread(at),
        "equal_tokens_steps": results[0]["eval_at_steps"],
        "equal_tokens_reached": len(at),
    }


def dilocod_summary(statuses: list[dict[str, Any]], before: list[int], peers: int) -> dict[str, Any]:
    """Outer steps are dilocod's rounds; a round with all peers is an outer step some peer applied in a
    group of every peer. Its eval is of θ_global (the model a peer publishes) at its latest outer step."""
    full = {
        e["outer_step"]
        for st in statuses
        for e in st["rounds"]
        if e["result"] == "ok" and e["group_size"] == peers
    }
    losses = [float(st["eval_loss"]) for st in statuses if st["eval_loss"] is not None]
    steps = [int(st["inner_step"]) for st in statuses]
    return {
        "steps_per_peer": round(statistics.mean(steps), 1),
        "steps": steps,
        "steps_before_clock": before,  # taken while the other peers were still starting
        "rounds": max(int(st["outer_step"]) for st in statuses),
        "rounds_full": len(full),
        "eval_equal_time": spread(losses),
        "eval_equal_tokens": spread(losses),  # its own step count is the one compared
        "equal_tokens_steps": round(statistics.mean(steps)),
    }


def dilocod_at_steps(statuses: list[dict[str, Any]], steps: float, step_tokens: int) -> dict[str, Any] | None:
    """θ_global's eval loss at the last outer step its peers reached within `steps` inner steps each (on
    average): dilocod's equal-tokens point when the hivemind side never reached dilocod's step count.

    A peer's steps at outer step s are the tokens of its rounds up to s ÷ the tokens of one inner step;
    θ_global at s is the same on every peer, so any peer's eval of it will do."""
    losses: dict[int, float] = {}
    tokens_at: dict[int, list[int]] = {}
    for st in statuses:
        total = 0
        for e in sorted(st["rounds"], key=lambda e: e["outer_step"]):
            total += int(e.get("tokens") or 0)
            if e["result"] == "ok":
                tokens_at.setdefault(e["outer_step"], []).append(total)
                if e.get("eval_loss") is not None:
                    losses[e["outer_step"]] = float(e["eval_loss"])
    reached = {
        step: statistics.mean(tokens_at[step]) / step_tokens
        for step in sorted(losses)
        if len(tokens_at[step]) == len(statuses)  # every peer applied it
    }
    within = [step for step, at in reached.items() if at <= steps]
    if not within:
        return None
    step = within[-1]
    return {"outer_step": step, "steps": round(reached[step]), "eval_loss": losses[step]}


def _loss(figures: dict[str, Any]) -> str:
    if figures["mean"] is None:
        return "-"
    return f"{figures['mean']:.3f} ({figures['min']:.3f}–{figures['max']:.3f})"


def _at(side: dict[str, Any]) -> str:
    if side["equal_tokens_steps"] is None:
        return "-"
    return f"{_loss(side['eval_equal_tokens'])} @ {side['equal_tokens_steps']} steps"


def table(result: dict[str, Any]) -> str:
    """The side-by-side table (markdown), one column per side that ran."""
    sides = [s for s in ("hivemind", "dilocod") if s in result]
    peers = result["peers"]
    rows: list[tuple[str, list[str]]] = [
        ("inner optimizer", [str(result[s].get("optimizer", "-")) for s in sides]),
        ("steps per peer (mean)", [f"{result[s]['steps_per_peer']:.1f}" for s in sides]),
        ("rounds (epochs / outer steps)", [str(result[s]["rounds"]) for s in sides]),
        (f"rounds with all {peers} peers", [str(result[s]["rounds_full"]) for s in sides]),
        ("eval loss, equal wall time", [_loss(result[s]["eval_equal_time"]) for s in sides]),
        (
            "eval loss, equal tokens",
            [_at(result[s]) for s in sides],
        ),
    ]
    header = ["", *[("hivemind.Optimizer (local updates)" if s == "hivemind" else "dilocod") for s in sides]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
    return "\n".join(lines)
