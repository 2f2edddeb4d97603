"""One process of the hivemind side: the run's DHT bootstrap, or one peer training with `hivemind.Optimizer`.

    python -m bench.anchor.worker bootstrap DIR        (writes DIR/bootstrap.maddr)
    python -m bench.anchor.worker train DIR INDEX      (reads DIR/race.json, writes DIR/result-INDEX.json)

A peer is dilocod's own `InnerTrainer` (the model, the data shard of its key, the batches, the AdamW, the
per-step lr schedule, clipping and the eval batches a dilocod peer of that key has; AdamW even where the
config says Muon) whose optimizer step goes through the stock `hivemind.Optimizer` with
`use_local_updates=True`: AdamW steps on local
gradients, parameters averaged with the other peers at every global epoch (`target_batch_size` samples
of the whole swarm). It says it is ready (DIR/ready-INDEX), trains from DIR/go for the race's seconds,
and evaluates the parameters it holds (what it would publish) at the end and when it passes the step
count of the dilocod side (equal tokens).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hivemind
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl

from bench.anchor.settings import HIVEMIND_OPTIMIZER
from dilocod.config import load_config
from dilocod.trainer import InnerTrainer

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
Started = list[tuple[Any, StepControl]]


def record_rounds() -> Started:
    """Every averaging round this process's averagers start, with the epoch it gathers for.

    hivemind reports a round's group only in a debug log line; the control it returns holds the group's
    gathered data (one entry per member) once the round is done, so the step that creates it is wrapped.
    """
    started: Started = []
    original = DecentralizedAverager.step

    def step(self: DecentralizedAverager, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if isinstance(result, StepControl):
            started.append((kwargs.get("gather"), result))
        return result

    DecentralizedAverager.step = step  # type: ignore[method-assign]
    return started


def group_sizes(started: Started) -> list[int]:
    """Members of each of this peer's finished parameter-averaging rounds, in order (failed ones left out).

    The epoch a round gathers for is not a key to match rounds across peers by: a pre-scheduled round
    gathers for the next epoch, one started at the epoch's end for the peer's epoch then, so the same
    all-reduce can carry different epochs on its members.
    """
    sizes = []
    for _, control in started:
        if not control.done() or control.cancelled():
            continue
        try:
            gathered = control.result(timeout=0)
        except BaseException:  # a failed round: hivemind goes on with local parameters
            continue
        if gathered:
            sizes.append(len(gathered))
    return sizes


class LocalUpdates:
    """What `InnerTrainer` steps as its optimizer: `hivemind.Optimizer`, with the lr set on the real AdamW.

    hivemind's own `param_groups` returns copies of the groups, so the trainer's per-step lr would be lost
    on them; its step (local AdamW step, progress report, averaging at the epoch's end) is unchanged.
    """

    def __init__(self, optimizer: hivemind.Optimizer) -> None:
        self.hivemind = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return list(self.hivemind.opt.param_groups)

    def step(self) -> None:
        self.hivemind.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.hivemind.zero_grad(set_to_none=set_to_none)


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} after {timeout:.0f}s")
        time.sleep(0.02)


def train(directory: Path, index: int) -> None:
    race = json.loads((directory / "race.json").read_text())
    cfg = load_config(race["config"], race["overrides"])
    started = record_rounds()  # before any averager exists
    settings = replace(cfg.trainer, optimizer=HIVEMIND_OPTIMIZER)
    trainer = InnerTrainer(cfg.model, cfg.data, settings, seed=cfg.run.seed, peer_key=race["keys"][index])
    dht = hivemind.DHT(initial_peers=race["initial_peers"], host_maddrs=LOOPBACK, start=True)
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id=race["run_id"],
        target_batch_size=race["target_batch_size"],
        batch_size_per_step=cfg.trainer.batch_size,
        optimizer=trainer.optimizer,  # an instance: local updates need no offloaded copy
        use_local_updates=True,
        matchmaking_time=race["matchmaking_time"],
        averaging_timeout=race["averaging_timeout"],
        averager_opts={"request_timeout": race["request_timeout"]},  # the config's, as dilocod's averager
        verbose=bool(race.get("verbose")),  # hivemind's progress lines into the worker's log
    )
    trainer.optimizer = LocalUpdates(optimizer)  # type: ignore[assignment]
    (directory / f"ready-{index}").touch()
    wait_for(directory / "go", timeout=race["start_timeout"])

    eval_at, at_steps = int(race["eval_at_steps"] or 0), None
    began = time.monotonic()
    deadline = began + race["seconds"]
    while time.monotonic() < deadline:
        trainer.train_steps(1)
        if trainer.step == eval_at:
            paused = time.monotonic()
            at_steps = {"eval_loss": trainer.evaluate(), "seconds": round(paused - began, 2)}
            deadline += time.monotonic() - paused  # the eval is not training time
    seconds = time.monotonic() - began
    result = {
        "index": index,
        "steps": trainer.step,
        "tokens": trainer.step * trainer.tokens_per_step,
        "seconds": round(seconds, 2),
        "epoch": optimizer.local_epoch,
        "eval_loss": trainer.evaluate(),
        "eval_at_steps": eval_at or None,
        "at_steps": at_steps,
        "groups": group_sizes(started),
    }
    partial = directory / f"result-{index}.json.part"
    partial.write_text(json.dumps(result))
    partial.rename(directory / f"result-{index}.json")  # whole or absent: the parent polls for it
    optimizer.shutdown()
    dht.shutdown()


def bootstrap(directory: Path) -> None:
    dht = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        partial = directory / "bootstrap.maddr.part"
        partial.write_text("\n".join(str(m) for m in dht.get_visible_maddrs()))
        partial.rename(directory / "bootstrap.maddr")
        while True:
            time.sleep(1)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "bootstrap":
        bootstrap(Path(sys.argv[2]))
    else:
        train(Path(sys.argv[2]), int(sys.argv[3]))
