"""A real swarm at size: per-phase time per round and each process's memory as bytes per parameter.

    .venv/bin/python bench/size.py [--preset 124m] [--peers 2] [--rounds 3] [--joiner] [--restart]
                                   [--set k=v ...] [--json]

A bootstrap and `--peers` peers of `--preset` through the CLI on loopback (the test harness's processes,
configs/tiny.toml with the preset swapped in, AdamW, batch 1 × 64 tokens, H = 3, int4, auto deadlines, a
checkpoint every round), until every peer is at outer step `--rounds`; with `--joiner` one more peer then
joins and downloads the run's state; with `--restart` the first peer's process group is then SIGKILLed
(a machine that dies) and the peer started again on its run directory. Reported:

- per round (medians over the peers' rounds after the first): the inner steps' time, matchmaking, the
  all-reduce and its goodput (the larger of the bytes sent and received ÷ its seconds), the rest (the outer
  step, eval, the checkpoint's pause), the checkpoint write (in the background), and a joiner's download;
- a restart: the outer step its checkpoint resumed it at, and the seconds from its start until it is
  at the run's next outer step;
- θ_global: every outer step at which the peers' reported hashes differ (none expected);
- memory, sampled every 2 s: each process of each peer's tree (the daemon, hivemind's DHT and averager
  forks, p2pd, torch's shm manager) as proportional set size (PSS) per parameter, at the end and at its
  peak, the tree's floor once every peer had averaged a round (what it holds between rounds; the end
  falls wherever in a round the last sample did), and at the end by kind of mapping (heap, anonymous,
  shared memory, files); the sum over a tree is the peer's memory (a page shared between a daemon and
  its forks counts once). Goal (issue 27): a CPU peer ≤ 32 bytes a parameter in all its processes together.

The 124m preset needs ~4 GB a peer: check `free -g` first. `--preset small` (20.7M) is a quick run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from procstats import memory_by_kind, pss_kb, tree  # noqa: E402

from dilocod.trainer import ModelConfig, count_params  # noqa: E402
from dilocod.trainer.model import Transformer  # noqa: E402
from tests.harness import Proc, Swarm, round_hashes  # noqa: E402

T = TypeVar("T")

SETTINGS = (
    "trainer.inner_steps=3",
    "trainer.batch_size=1",
    "trainer.seq_len=64",
    "trainer.warmup_steps=1",
    "trainer.eval_batches=1",
    "trainer.threads=1",
    "trainer.optimizer=adamw",
    "averaging.min_matchmaking_time=1.5",
    "averaging.request_timeout=1",
    "averaging.matchmaking_timeout=0",  # auto: from the model and the link (peers/linkbudget.py)
    "averaging.allreduce_timeout=0",
    "averaging.state_timeout=0",
    "net.status_interval=1",
)


def process_names(root: int) -> dict[int, str]:
    """Each process of a daemon's tree by role: hivemind forks the DHT before the averager."""
    names, forks = {}, 0
    for pid in sorted(tree(root)):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if pid == root:
            names[pid] = "daemon"
        elif comm == "python":
            names[pid] = ("dht", "averager")[forks] if forks < 2 else f"fork{forks}"
            forks += 1
        else:
            names[pid] = comm.replace("torch_shm_manag", "shm_manager")
    return names


class Sampler:
    """Every 2 s, each process's PSS (MB), keyed by peer and role; keeps the last reading and the peak."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.last: dict[str, dict[str, float]] = {}
        self.peak: dict[str, dict[str, float]] = {}
        self.peak_total: dict[str, float] = {}
        # The least a peer held once training had begun (set `steady` then): its state between rounds,
        # where `last` is wherever in a round the final sample fell.
        self.steady = False
        self.floor_of = {proc.name for proc in procs}  # not a peer that joins later: it starts from nothing
        self.floor_total: dict[str, float] = {}
        self.kinds: dict[str, dict[str, dict[str, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self.read()

    def _each_process(self, measure: Callable[[int], T]) -> dict[str, dict[str, T]]:
        """`measure(pid)` of each process of each live peer's tree, keyed by peer and role."""
        found: dict[str, dict[str, T]] = {}
        for proc in list(self.procs):
            if proc.popen is None or proc.popen.poll() is not None:
                continue
            parts: dict[str, T] = {}
            for pid, role in process_names(proc.popen.pid).items():
                try:
                    parts[role] = measure(pid)
                except OSError:  # the process ended meanwhile
                    continue
            found[proc.name] = parts
        return found

    def read(self) -> None:
        for name, parts in self._each_process(lambda pid: pss_kb(pid) / 1024).items():
            self.last[name] = parts
            peak = self.peak.setdefault(name, {})
            for role, mb in parts.items():
                peak[role] = max(peak.get(role, 0.0), mb)
            total = sum(parts.values())
            self.peak_total[name] = max(self.peak_total.get(name, 0.0), total)
            if self.steady and name in self.floor_of:
                self.floor_total[name] = min(self.floor_total.get(name, total), total)

    def read_kinds(self) -> None:
        """Each process's PSS by kind of mapping (heap, anon, shm, file): what the copies are."""
        self.kinds.update(self._each_process(memory_by_kind))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def metric_sums(proc: Proc, names: tuple[str, ...]) -> dict[str, float]:
    """`<name>_sum` and `<name>_count` of a peer's histograms, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            for suffix in ("_sum", "_count"):
                if line.startswith(f"dilocod_{name}{suffix} "):
                    found[name + suffix] = float(line.split()[1])
    return found


def phases(proc: Proc) -> dict[str, Any]:
    """One peer's per-round times (medians over its rounds after the first) and all-reduce goodput."""
    status = proc.status()
    rounds = [r for r in status["rounds"] if r["result"] in ("ok", "alone")][1:]
    sums = metric_sums(proc, ("inner_step_seconds", "checkpoint_seconds"))
    steps = sums.get("inner_step_seconds_count", 0) or 1
    step_seconds = sums.get("inner_step_seconds_sum", 0.0) / steps
    gaps = [b["time"] - a["time"] for a, b in zip(status["rounds"], status["rounds"][1:], strict=False)]
    med = statistics.median

    def goodput(r: dict[str, Any]) -> float:
        return max(r["bytes_sent"], r["bytes_received"]) / max(r["allreduce_seconds"], 1e-9) / 1e6

    return {
        "rounds": len(rounds),
        "inner_step_s": round(step_seconds, 3),
        "train_s": round(step_seconds * 3, 2),  # H = 3 steps a round for a peer of the run's speed
        "round_gap_s": round(med(gaps[1:]), 2) if len(gaps) > 1 else None,
        "matchmaking_s": round(med(r["seconds"] - r["allreduce_seconds"] for r in rounds), 2) if rounds else None,
        "allreduce_s": round(med(r["allreduce_seconds"] for r in rounds), 2) if rounds else None,
        "allreduce_mb": round(med(max(r["bytes_sent"], r["bytes_received"]) for r in rounds) / 1e6, 1)
        if rounds
        else None,
        "goodput_mb_s": round(med(goodput(r) for r in rounds), 1) if rounds else None,
        "checkpoint_write_s": round(sums.get("checkpoint_seconds_sum", 0) / max(1, sums.get("checkpoint_seconds_count", 0)), 2),
    }  # fmt: skip


def joiner_download(proc: Proc) -> dict[str, Any] | None:
    """The joiner's state download, from its `/api/status` `state_fetch` (the download in parts): its
    seconds, bytes, parts and donors; None before it downloaded."""
    fetch = proc.status().get("state_fetch")
    if not fetch or fetch.get("active", True):
        return None
    return {
        "download_s": fetch.get("seconds"),
        "download_mb": round(fetch.get("bytes_total", 0) / 1e6, 1),
        "parts": fetch.get("parts_total"),
        "donors": len(fetch.get("parts_from") or {}),
        "error": fetch.get("error"),
    }


def restart(s: Swarm, proc: Proc, timeout: float) -> dict[str, Any]:
    """SIGKILL `proc`'s process group, start it again on its run directory, and wait until it is at the
    run's next outer step: the step its checkpoint resumed it at and how long it took to be back."""
    proc.reap()
    killed_at = max(p.status()["outer_step"] for p in s.peers if p is not proc)
    started = time.monotonic()
    proc.start()
    s.wait_serving(proc, timeout=timeout)
    s.wait_all_at(killed_at + 1, timeout=timeout, peers=[proc])
    found = re.findall(r"resumed from checkpoint at outer step (\d+)", proc.output())
    return {
        "killed_at_run_step": killed_at,
        "resumed_at_step": int(found[-1]) if found else None,
        "back_s": round(time.monotonic() - started, 1),
        "outer_step": proc.status()["outer_step"],
    }


def theta_splits(procs: list[Proc]) -> list[int]:
    """The outer steps at which the peers report different θ_global hashes (a split run)."""
    return sorted(
        step for step, hashes in round_hashes([p.status() for p in procs]).items() if len(hashes) > 1
    )


def memory_table(sampler: Sampler, params: int) -> list[dict[str, Any]]:
    rows = []
    for name, parts in sampler.last.items():
        per = {role: round(mb * 2**20 / params, 1) for role, mb in parts.items()}
        peak = {role: round(mb * 2**20 / params, 1) for role, mb in sampler.peak.get(name, {}).items()}
        rows.append({
            "process": name,
            "mb": {role: round(mb) for role, mb in parts.items()},
            "bytes_per_param": per,
            "total_bytes_per_param": round(sum(parts.values()) * 2**20 / params, 1),
            "peak_bytes_per_param": peak,
            "peak_total_bytes_per_param": round(sampler.peak_total.get(name, 0.0) * 2**20 / params, 1),
            "floor_total_bytes_per_param": round(sampler.floor_total.get(name, 0.0) * 2**20 / params, 1),
            "by_kind_bytes_per_param": {
                role: {k: round(mb * 2**20 / params, 1) for k, mb in kinds.items()}
                for role, kinds in sampler.kinds.get(name, {}).items()
            },
        })  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="124m")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--joiner", action="store_true", help="one more peer joins at the end and downloads the state"
    )
    p.add_argument(
        "--restart", action="store_true", help="then SIGKILL the first peer and start it again on its run dir"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with torch.device("meta"):  # the count without the memory
        params = count_params(Transformer(ModelConfig(args.preset).spec()))
    overrides = (*SETTINGS, f"model.preset={args.preset}", *args.overrides)
    result: dict[str, Any] = {"preset": args.preset, "params": params, "peers": args.peers}
    with tempfile.TemporaryDirectory(prefix="dilocod-size-") as root:
        s = Swarm(Path(root), overrides=overrides)
        sampler: Sampler | None = None
        try:
            s.start_bootstrap()
            for _ in range(args.peers):
                s.add_peer()
            assert s.bootstrap is not None
            sampler = Sampler([s.bootstrap, *s.peers])
            s.wait_all_at(1, timeout=args.timeout)
            sampler.steady = True
            s.wait_all_at(args.rounds, timeout=args.timeout)
            time.sleep(3)  # the last round's checkpoint and trim
            sampler.read()
            sampler.read_kinds()
            result["phases"] = {proc.name: phases(proc) for proc in s.peers}
            if args.joiner:
                joiner = s.add_peer()
                sampler.procs.append(joiner)
                at = max(st["outer_step"] for st in (proc.status() for proc in s.peers[:-1]))
                s.wait_all_at(at + 1, timeout=args.timeout, peers=[joiner])
                result["joiner"] = joiner_download(joiner)
                sampler.read()
            result["memory"] = memory_table(sampler, params)
            if args.restart:
                sampler.steady = False  # a process starting again is no peer's floor
                again = s.peers[0]
                result["restart"] = restart(s, again, args.timeout)
                sampler.read()
                now = sum(sampler.last.get(again.name, {}).values())
                result["restart"]["total_bytes_per_param"] = round(now * 2**20 / params, 1)
            result["theta_splits"] = theta_splits(s.peers)
        except Exception:
            print(s.log_tails(), file=sys.stderr)
            raise
        finally:
            if sampler is not None:
                sampler.stop()
            s.close()
    report(result)
    if args.json:
        print(json.dumps(result))
    return 0


def report(result: dict[str, Any]) -> None:
    print(f"{result['preset']}: {result['params']:,} parameters, bootstrap + {result['peers']} peers")
    for name, ph in result.get("phases", {}).items():
        print(f"  {name}: {ph}")
    if result.get("joiner"):
        print(f"  joiner: {result['joiner']}")
    if result.get("restart"):
        print(f"  restart: {result['restart']}")
    if "theta_splits" in result:
        print(f"  outer steps with differing θ_global hashes: {result['theta_splits'] or 'none'}")
    print("memory, bytes per parameter (PSS) now [peak] (total's floor after the first round):")
    for row in result.get("memory", []):
        parts = "  ".join(
            f"{role} {v} [{row['peak_bytes_per_param'].get(role, v)}]"
            for role, v in row["bytes_per_param"].items()
        )
        print(
            f"  {row['process']:<10} total {row['total_bytes_per_param']} [{row['peak_total_bytes_per_param']}] "
            f"({row['floor_total_bytes_per_param']})  {parts}"
        )
        for role, kinds in row.get("by_kind_bytes_per_param", {}).items():
            print(f"    {role:<12} " + "  ".join(f"{k} {v}" for k, v in kinds.items()))


if __name__ == "__main__":
    sys.exit(main())
