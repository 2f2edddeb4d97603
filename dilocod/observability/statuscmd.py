"""`dilocod status [URL] [--watch]`: the run as a terminal table, read from any node's JSON API.

URL is a bootstrap's dashboard (`dilocod bootstrap --http-port`) or a peer's HTTP API (`dilocod join
--http-port`); a peer answers with its own view of the run. The table lists every live peer: its step,
loss, tokens/s and last round. `--watch` redraws it every few seconds until Ctrl-C.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

from dilocod.observability.progress import duration

DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_SECONDS = 5.0
STALE_SECONDS = 30.0


class StatusError(Exception):
    """The node could not be reached or did not answer like a dilocod node."""


def normalize_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise StatusError(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot reach {url}: {reason}") from None
    except ValueError:
        raise StatusError(f"{url} did not answer with JSON; is it a dilocod node?") from None


def fetch(base: str) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """This node's status, the run's live peer records and its progress through its dataset, as the node
    at `base` sees them."""
    status = _get_json(f"{base}/api/status")
    run = _get_json(f"{base}/api/run")
    records = run.get("peers") if isinstance(run, dict) else None
    if not isinstance(status, dict) or not isinstance(records, list):
        raise StatusError(f"{base} did not answer like a dilocod node")
    records = [r for r in records if isinstance(r, dict) and r.get("peer_id")]
    own = status.get("peer_id")
    if status.get("role") == "peer" and own and all(r["peer_id"] != own for r in records):
        records.insert(0, {**status, "time": time.time()})  # its own record may not be in the DHT yet
    dataset = run.get("dataset")
    return status, records, dataset if isinstance(dataset, dict) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _f(value: Any, digits: int = 3) -> str:
    v = _num(value)
    return "–" if v is None else f"{v:.{digits}f}"


def _i(value: Any) -> str:
    v = _num(value)
    return "–" if v is None else f"{v:,.0f}"


def _age(seconds: float | None) -> str:
    return "–" if seconds is None else duration(seconds)


def short_id(peer_id: str) -> str:
    return "…" + peer_id[-10:] if len(peer_id) > 11 else peer_id


COLUMNS = ("PEER", "ROLE", "REACH", "OUTER", "INNER", "LOSS", "EVAL", "TOKENS/S", "SHARE", "GROUP",
           "LAST ROUND", "OK/FAILED", "θ SHA256", "SEEN")  # fmt: skip
LEFT = {"PEER", "ROLE", "REACH", "θ SHA256"}


def render(
    status: dict[str, Any],
    records: list[dict[str, Any]],
    base: str,
    *,
    wide: bool = False,
    now: float | None = None,
    dataset: dict[str, Any] | None = None,
) -> str:
    """The whole report as text: a summary line, then one row per live peer."""
    now = time.time() if now is None else now
    peers = [r for r in records if r.get("role") == "peer"]
    own = status.get("peer_id") or ""
    served = status.get("role") or "node"
    tps = sum(_num(r.get("tokens_per_second")) or 0.0 for r in peers)
    steps = [int(r.get("outer_step") or 0) for r in peers]
    losses = [v for v in (_num(r.get("loss")) for r in peers) if v is not None]
    run_id = status.get("run_id") or (records[0].get("run_id") if records else "?")
    summary = (
        f"run {run_id} · via {served} {short_id(own) if own else ''} ({base}) · "
        f"{len(peers)} peer{'s' if len(peers) != 1 else ''} · {tps:,.0f} tokens/s"
    )
    if steps:
        summary += f" · outer step {max(steps)}" + (
            f" (slowest {min(steps)})" if min(steps) != max(steps) else ""
        )
    if losses:
        summary += f" · loss {sum(losses) / len(losses):.3f}"
    trained = sum(_num(r.get("tokens_trained")) or 0.0 for r in peers)
    if trained > 0:
        reached = sum(_num(r.get("tokens_contributed")) or 0.0 for r in peers)
        summary += f" · {100 * reached / trained:.0f}% of tokens reached θ_global"
    if dataset and _num(dataset.get("epoch_fraction")) is not None:
        summary += (
            f" · dataset epoch {_i(dataset.get('epoch'))} {100 * float(dataset['epoch_fraction']):.1f}%"
            f" ({_i(dataset.get('chunks_trained'))}/{_i(dataset.get('chunks_total'))} chunks)"
        )
    rows = []
    for r in records:
        peer_id = str(r.get("peer_id") or "")
        name = (peer_id if wide else short_id(peer_id)) + ("*" if peer_id == own else "")
        seen = now - r["time"] if _num(r.get("time")) is not None else None
        reach = {"private": "relayed"}.get(
            str(r.get("reachability")), str(r.get("reachability") or "unknown")
        )
        group = _i(r.get("group_size")) + (" alone" if r.get("alone") else "")
        last = _num(r.get("last_round_seconds"))
        rows.append(
            (
                name, str(r.get("role") or "?") + (" ≠manifest" if r.get("other_manifest") else ""), reach, _i(r.get("outer_step")), _i(r.get("inner_step")),
                _f(r.get("loss")), _f(r.get("eval_loss")), _i(r.get("tokens_per_second")), _share(r), group,
                "–" if last is None else f"{last:.1f}s", f"{_i(r.get('rounds_ok'))}/{_i(r.get('rounds_failed'))}",
                str(r.get("global_sha256") or "")[:12],
                _age(seen) + (" (stale)" if seen is not None and seen > STALE_SECONDS else ""),
            )
        )  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) if name in LEFT else c.rjust(w) for c, w, name in zip(cells, widths, COLUMNS)]
        return "  ".join(out).rstrip()

    lines = [summary, "", line(COLUMNS), *(line(row) for row in rows)]
    if not rows:
        lines.append("(no live peer records yet)")
    elif own and any(r.get("peer_id") == own for r in records):
        lines.append("* the node that answered")
    if any(r.get("other_manifest") for r in records):
        lines.append(
            "≠manifest: runs another run manifest than the node that answered; it never averages with the run"
        )
    if status.get("not_contributing_reason"):
        lines.append(f"the node that answered is not contributing: {status['not_contributing_reason']}")
    return "\n".join(lines)


def _share(record: dict[str, Any]) -> str:
    """Its tokens that reached θ_global ÷ tokens trained; `!` marks a peer that says it is not contributing."""
    trained, reached = _num(record.get("tokens_trained")), _num(record.get("tokens_contributed"))
    mark = "!" if record.get("contributing") is False else ""
    return "–" if not trained or reached is None else f"{100 * reached / trained:.0f}%{mark}"


def run_status(
    url: str,
    *,
    watch: bool = False,
    interval: float = 2.0,
    count: int = 0,
    wide: bool = False,
    out: TextIO | None = None,
) -> int:
    """Print the run once (exit 1 if the node cannot be reached) or, with `watch`, until interrupted."""
    out = out if out is not None else sys.stdout
    base = normalize_url(url)
    if not watch:
        try:
            status, records, dataset = fetch(base)
        except StatusError as e:
            print(f"dilocod: error: {e}", file=sys.stderr)
            return 1
        print(render(status, records, base, wide=wide, dataset=dataset), file=out, flush=True)
        return 0
    tty = out.isatty()
    shown = 0
    try:
        while True:
            try:
                status, records, dataset = fetch(base)
                text = render(status, records, base, wide=wide, dataset=dataset)
            except StatusError as e:
                text = f"dilocod: {e} (retrying)"
            stamp = time.strftime("%H:%M:%S")
            footer = f"updated {stamp} · every {interval:g}s · Ctrl-C stops"
            if tty:
                out.write("\x1b[H\x1b[2J")  # home, clear screen
            elif shown:
                out.write("\n")
            out.write(f"{text}\n{footer}\n")
            out.flush()
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
