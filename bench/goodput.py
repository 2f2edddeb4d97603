"""All-reduce goodput ÷ link rate on shaped links: the public-reducer star and the peer-to-peer butterfly.

    .venv/bin/python bench/goodput.py --topology star --peers 2,4 [--rate 50] [--delay-ms 0] \
        [--preset small | --floats N] [--rounds 2]

Needs root (network namespaces: tests/netbed.py, docs/testbed.md). No trainer runs: each peer is one
small process (this file, `--role peer`) inside its own namespace that starts a DHT node and the run's
averager (peers/group.py) on random tensors of the preset's parameter shapes, and averages them
`--rounds` times after one warm-up round.

- star: n peers behind their own NATs (client mode: they send and receive, reduce nothing), each on a
  link of `--rate` Mbit/s, and one auxiliary reducer in the public host `pub` (what `dilocod bootstrap`
  runs), whose link is unshaped unless `--reducer-rate` is given.
- p2p: n public peers, each on a link of `--rate` Mbit/s, all reducing (hivemind's butterfly); `pub`
  holds only a DHT node.

A round's time is from the first member entering the all-reduce (matchmaking excluded) to the last
member holding the average, on the machine's monotonic clock (shared by all namespaces). Goodput =
|Δ| (fp32 bits) ÷ that time; the table gives it ÷ the link rate, and ÷ the physical bound of the same
ratio: a butterfly member sends and receives 2·(n−1)/n·|Δ| over its link, so goodput ≤ rate·n/(2(n−1));
a star client sends |Δ| and receives |Δ|, so ≤ rate with both directions overlapped, ≤ rate/2 when the
average comes back only after all was sent; the reducer's own link carries n·|Δ| each way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RUN_ID = "goodput"
READY_TIMEOUT = 300.0  # every peer's DHT and averager up (8 peers starting torch on 2 cores is slow)


# ---- one peer (runs inside its namespace) -------------------------------------------------------------


def _shapes(preset: str, floats: int | None) -> list[Any]:
    import torch

    if floats:
        return [torch.Size([floats])]
    from dilocod.node.helper import parameter_shapes
    from dilocod.trainer.model import ModelConfig

    return parameter_shapes(ModelConfig(preset=preset))


async def _peer_main(args: argparse.Namespace) -> None:
    import torch

    from peers.group import AveragingSettings, GroupAverager
    from peers.node import Node, NodeSettings
    from proto import encode_ticket

    torch.set_num_threads(1)
    out = Path(args.out)
    mode = args.mode
    node = Node(
        NodeSettings(
            run_id=RUN_ID,
            initial_peers=tuple(args.initial),
            host=args.host,
            client_mode=mode == "client",
            reachability="private" if mode == "client" else "public",
        )
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, node.start)
    if mode == "dht":  # p2p's pub: a DHT node the peers find each other through, nothing else
        out.with_suffix(".maddr").write_text(node.visible_maddrs()[0])
        while True:
            await asyncio.sleep(3600)
    g = torch.Generator().manual_seed(args.seed)
    tensors = [torch.randn(shape, generator=g) for shape in _shapes(args.preset, args.floats)]
    size = sum(t.numel() for t in tensors)
    members = args.n + (1 if args.aux else 0)
    options = AveragingSettings(
        target_group_size=members,
        min_group_size=members,  # every round is the whole group, or none
        min_matchmaking_time=3.0,
        matchmaking_timeout=60.0,
        allreduce_timeout=args.allreduce_timeout,
        request_timeout=5.0,
        mode=mode,
    )
    group = GroupAverager(node, tensors, options, state_provider=None)
    group.start()
    if mode == "aux":
        out.with_suffix(".maddr").write_text(node.visible_maddrs()[0])
    out.with_suffix(".ready").write_text("")
    go = out.parent / "go"
    while not go.exists():
        await asyncio.sleep(0.1)
    role = "helper" if mode == "aux" else "peer"
    claim = (
        {"tokens": 1000, "tokens_per_second": 100.0, "train_seconds": 10.0}
        if role == "peer"
        else {"tokens": 0, "tokens_per_second": 0.0, "train_seconds": 0.0}
    )
    ticket = encode_ticket(
        {"outer_step": 0, "global_sha256": "0" * 64, "num_params": size, "role": role, **claim}
    )
    records = []
    for index in range(args.rounds + 1):  # round 0 warms connections up
        for attempt in range(3):
            began: list[float] = []
            watcher = asyncio.create_task(_allreduce_start(group, began))
            outcome = await group.average(index, ticket, tensors)
            ended = time.monotonic()
            watcher.cancel()
            ok = outcome.error is None and (mode == "aux" or outcome.averaged is not None)
            record = dict(
                round=index,
                attempt=attempt,
                ok=ok,
                error=outcome.error,
                began=began[0] if began else None,
                ended=ended,
                group_size=outcome.group_size,
                bytes_sent=outcome.bytes_sent,
                bytes_received=outcome.bytes_received,
                size=size,
            )
            records.append(record)
            out.with_suffix(".json").write_text(json.dumps(records))
            if ok:
                break
    # Stay until every member is done: a member that leaves at once would cut the others off from the
    # parts it still has to send them (its own average can be complete before theirs).
    out.with_suffix(".done").write_text("")
    deadline = time.monotonic() + 120
    while not (out.parent / "stop").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    group.stop()
    node.stop()


async def _allreduce_start(group: Any, began: list[float]) -> None:
    """Append the moment this member starts exchanging tensors (polls the averager's shared stage)."""
    from hivemind.averaging.control import AveragingStage

    while True:
        control = group._control
        if control is not None and not control.done() and control.stage == AveragingStage.RUNNING_ALLREDUCE:
            began.append(time.monotonic())
            return
        await asyncio.sleep(0.005)


# ---- the orchestrator (root namespace) ----------------------------------------------------------------


def _peer_argv(
    args: argparse.Namespace, out: Path, mode: str, host: str, initial: list[str], n: int
) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "peer", "--mode", mode, "--host", host]
    argv += ["--out", str(out), "--n", str(n), "--rounds", str(args.rounds), "--preset", args.preset]
    argv += ["--allreduce-timeout", str(args.allreduce_timeout), "--seed", str(abs(hash(out.name)) % 2**31)]
    if args.floats:
        argv += ["--floats", str(args.floats)]
    if args.topology == "star":
        argv += ["--aux"]
    for maddr in initial:
        argv += ["--initial", maddr]
    return argv


def _wait_files(paths: list[Path], timeout: float, procs: list[subprocess.Popen[Any]], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: process #{dead[0]} exited early, see the logs in its work dir")
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise RuntimeError(f"{what}: timed out after {timeout:.0f}s, missing {missing}")
        time.sleep(0.2)


def run_one(args: argparse.Namespace, n: int, work: Path) -> dict[str, Any]:
    """One topology with n peers in a fresh bed; returns the per-round timings."""
    from tests.netbed import NetBed

    work.mkdir(parents=True, exist_ok=True)
    logs: list[Any] = []
    with NetBed() as bed:
        procs: list[subprocess.Popen[Any]] = []

        def start(host: str, argv: list[str], name: str) -> None:
            log = (work / f"{name}.log").open("wb")
            logs.append(log)
            procs.append(bed.run(host, argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path.cwd()))

        if args.topology == "star":
            if args.reducer_rate:
                bed.shape("pub", rate_mbit=args.reducer_rate, delay_ms=args.delay_ms)
            hub, hub_mode, peer_mode = work / "reducer", "aux", "client"
        else:
            hub, hub_mode, peer_mode = work / "dht", "dht", "node"
        start("pub", _peer_argv(args, hub, hub_mode, bed.addr("pub"), [], n), hub.name)
        _wait_files([hub.with_suffix(".maddr")], READY_TIMEOUT, procs, "the public node")
        maddr = hub.with_suffix(".maddr").read_text().strip()
        outs = []
        for i in range(n):
            host = f"p{i}"
            if args.topology == "star":
                bed.add_nat(host, rate_mbit=args.rate, delay_ms=args.delay_ms)
            else:
                bed.add_public(host, rate_mbit=args.rate, delay_ms=args.delay_ms)
            out = work / host
            outs.append(out)
            start(host, _peer_argv(args, out, peer_mode, bed.addr(host), [maddr], n), host)
        members = outs + ([hub] if args.topology == "star" else [])
        _wait_files([o.with_suffix(".ready") for o in members], READY_TIMEOUT, procs, "peers starting")
        (work / "go").write_text("")
        per_round = 3 * (args.allreduce_timeout + 80)
        _wait_files([o.with_suffix(".done") for o in members], per_round * (args.rounds + 1), procs, "rounds")
        (work / "stop").write_text("")
        guard = bed.guard_violations()
    for log in logs:
        log.close()
    results = {o.name: json.loads(o.with_suffix(".json").read_text()) for o in outs}
    return {"n": n, "guard_violations": guard, "peers": results}


def summarize(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    n, rate = result["n"], args.rate * 1e6
    peers = result["peers"]
    size = next(iter(peers.values()))[0]["size"]
    bits = size * 32
    times = []
    for index in range(1, args.rounds + 1):
        final = [next((r for r in recs if r["round"] == index and r["ok"]), None) for recs in peers.values()]
        if any(r is None or r["began"] is None for r in final):
            continue  # a member failed this round (reported as missing)
        times.append(max(r["ended"] for r in final) - min(r["began"] for r in final))  # type: ignore[index]
    sent = statistics.mean(
        r["bytes_sent"] for recs in peers.values() for r in recs if r["ok"] and r["round"] > 0
    )
    if args.topology == "p2p":
        bound, bound_seq = n / (2 * (n - 1)), n / (2 * (n - 1))
    else:
        bound, bound_seq = 1.0, 0.5
        if args.reducer_rate:  # the reducer's link carries n·|Δ| each way
            bound = min(bound, args.reducer_rate / args.rate / n)
            bound_seq = min(bound_seq, args.reducer_rate / args.rate / (2 * n))
    t = statistics.median(times) if times else math.nan
    ratio = bits / t / rate if times else math.nan
    return dict(
        topology=args.topology,
        n=n,
        floats=size,
        rate_mbit=args.rate,
        delay_ms=args.delay_ms,
        rounds_ok=len(times),
        seconds=t,
        seconds_all=[round(x, 2) for x in times],
        goodput_over_rate=ratio,
        bound=bound,
        of_bound=ratio / bound,
        of_sequential_bound=ratio / bound_seq,
        mean_bytes_sent_over_delta=sent / (size * 4),
        guard_violations=result["guard_violations"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("bench", "peer"), default="bench")
    ap.add_argument("--topology", choices=("star", "p2p"), default="star")
    ap.add_argument("--peers", default="2,4,8", help="comma-separated group sizes")
    ap.add_argument("--rate", type=float, default=50.0, help="each peer's link, Mbit/s (both directions)")
    ap.add_argument("--reducer-rate", type=float, default=0.0, help="star: the reducer's link (0 = unshaped)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on every shaped link")
    ap.add_argument("--preset", default="small", help="|Δ| = this preset's parameters")
    ap.add_argument(
        "--floats", type=int, default=0, help="instead of a preset: one tensor of this many floats"
    )
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up)")
    ap.add_argument("--allreduce-timeout", type=float, default=300.0)
    ap.add_argument("--work", type=Path, default=None, help="logs and per-peer results (default: a temp dir)")
    # --role peer only
    ap.add_argument("--mode", choices=("client", "node", "aux", "dht"))
    ap.add_argument("--host")
    ap.add_argument("--out")
    ap.add_argument("--n", type=int)
    ap.add_argument("--aux", action="store_true")
    ap.add_argument("--initial", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.role == "peer":
        asyncio.run(_peer_main(args))
        return
    from tests.netbed import require_netns

    require_netns()
    # `timeout`/kill: unwind through the beds' `with` so that every namespace and process goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work or Path(tempfile.mkdtemp(prefix="goodput-"))
    print(f"# work dir {work}", flush=True)
    for n in (int(x) for x in args.peers.split(",")):
        started = time.monotonic()
        summary = summarize(args, run_one(args, n, work / f"{args.topology}-{n}"))
        summary["wall_s"] = round(time.monotonic() - started, 1)
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
