"""The simulated run: peers train on the run's clock, close rounds, meet, average, re-sync, leave and join,
each decision taken by the daemon's own functions (see the package docstring), on a simulated clock.

A peer's life is the round machine's loop: the machine's command (`Train`, `Average`, `Download`) becomes
simulated time here, and its outcome the machine's next event. Records are what each peer publishes every
`net.status_interval`; the run's clock reads them at `clock.refresh_interval` (one read for everyone: all
peers see the same records, so per-peer DHT lag is not modelled, only its cost).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hivemind.averaging.allreduce import AveragingMode

from bench.netsim import costs
from bench.netsim.coordinator import Coordinator, IndexedBook
from bench.netsim.matchmaking import Group, Rules, Seeker, form_groups
from bench.netsim.population import Peer, draw_traits, new_peer
from bench.netsim.queue import EventQueue
from bench.netsim.report import Tally
from bench.netsim.settings import RunParams, Scenario, run_params
from bench.netsim.statefetch import download_seconds
from bench.netsim.upkeep import Upkeep
from dilocod.node.chunks import SYNC_SECONDS
from dilocod.rounds import clock, facts, machine
from dilocod.rounds.events import (
    Action,
    Apply,
    Attempt,
    Average,
    Averaged,
    Closed,
    Download,
    Record,
    Synced,
    Train,
)
from dilocod.trust.scoring import assign_scorers
from peers.grouping import matchmaking_window, round_group_bits
from peers.linkbudget import MBIT, PREPARE_SECONDS_PER_ELEMENT, allreduce_deadline

BOOTSTRAP = "bootstrap"
START_JITTER = 2.0  # peers of a cold start come up within this many seconds
STALL_ROUNDS = 5  # a run that closes no round in this many `round.max_seconds` has stalled: it stops there
TICKET_BYTES = 400  # a round ticket with its chunks and the envelope (proto/records.py ROUND_TICKET ≤ 2048)


@dataclass
class RoundBook:
    """What the simulation knows about one round index while it is open."""

    index: int
    attempt: int = 0  # a round whose groups all failed is tried again at the same index: a new book
    seekers: dict[str, Seeker] = field(default_factory=dict)
    live_at_close: int = 0
    settled: bool = False  # its groups formed: a later seeker finds nobody to meet
    open_groups: int = 0  # groups still exchanging

    @property
    def over(self) -> bool:
        """Every group it formed is done: whoever trains this index again meets in a new matchmaking."""
        return self.settled and self.open_groups == 0


class Simulation(Upkeep):
    def __init__(self, scenario: Scenario, params: RunParams | None = None) -> None:
        scenario.validate()
        self.scenario, self.params = scenario, params or run_params(scenario)
        self.rng = random.Random(scenario.seed)
        self.queue = EventQueue()
        cfg = self.params.cfg
        book = IndexedBook(scenario.train_tokens, cfg.data.chunk_tokens, "netsim", cfg.data.lease_seconds)
        self.coordinator = Coordinator(book)
        self.peers: dict[str, Peer] = {}
        self.records: dict[str, dict[str, Any]] = {}
        # Caches, each of a pure function of what it is keyed on (see `_wrote`): the records as the clock
        # reads them, the fresh records at one moment, and the reducers the facts count.
        self._parsed: dict[str, tuple[clock.Progress | None, clock.Joiner | None]] = {}
        self._version = 0  # bumped at every record write
        self._fresh_at: tuple[float, int, list[dict[str, Any]]] = (-1.0, -1, [])
        self._reducers_at: tuple[tuple[int, int], int] = ((-1, -1), 0)
        self.rounds: dict[int, RoundBook] = {}
        self.tally = Tally(scenario.rounds, bytes_per_token=costs.bytes_per_token(self.params.vocab_size))
        self.record_bytes = costs.status_record_bytes()
        self.joined = 0
        self.live = 0  # peers alive
        self.finished = 0  # rounds closed so far …
        self.progress_at = 0.0  # … and when the last one closed
        self.stalled = False
        self.group_key = round_group_bits(0, cfg.averaging.compression, None, "netsim")

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        for i in range(self.scenario.peers):
            self._start(
                draw_traits(self.rng, self.scenario, i), self.rng.uniform(0, START_JITTER), joiner=False
            )
        self.joined = self.scenario.peers
        self.queue.at(0.0, self._tick)
        self.queue.at(0.0, self._expire)
        if self.scenario.churn > 0:
            self.queue.at(self._next_churn(), self._churn)
        horizon = self.scenario.rounds * 20 * self.params.cfg.round.max_seconds
        self.queue.run_until(self._done, horizon)
        self.stalled = self.tally.finished_rounds < self.scenario.rounds
        for peer in self.peers.values():
            self._account_alive(peer)
        return self.tally.report(self)

    def _done(self) -> bool:
        """All rounds closed, or none for STALL_ROUNDS × `round.max_seconds` (the run stalled: said so in the
        result, never a hang)."""
        finished = self.tally.finished_rounds
        if finished > self.finished:
            self.finished, self.progress_at = finished, self.queue.now
        stall = STALL_ROUNDS * self.params.cfg.round.max_seconds
        return finished >= self.scenario.rounds or self.queue.now - self.progress_at > stall

    def _start(self, traits: Any, at: float, joiner: bool) -> None:
        peer = new_peer(traits, self.params, at)
        self.peers[peer.peer_id] = peer
        self.live += 1
        if joiner:
            peer.machine = machine.RoundState(step=-1)
            self.queue.at(at, lambda: self._join(peer))
        else:
            self.queue.at(at, lambda: self._train(peer))
        self.queue.at(at, lambda: self._publish(peer))  # a daemon publishes its first record as it starts
        self.queue.at(at + self.rng.uniform(0, SYNC_SECONDS), lambda: self._chunk_sync(peer))

    # ---- a peer's round --------------------------------------------------------------------------------
    def _train(self, peer: Peer) -> None:
        if not peer.alive:
            return
        now = self.queue.now
        peer.training_since, peer.round_tokens, peer.stopping = now, 0, False
        if peer.round_opened is None or peer.opened_round != peer.machine.round:
            peer.round_opened, peer.opened_round = now, peer.machine.round
        self._publish_now(peer)

    def _closed(self, peer: Peer, steps: int) -> None:
        if not peer.alive:
            return
        now = self.queue.now
        assert peer.training_since is not None
        peer.train_seconds += now - peer.training_since
        peer.round_tokens = steps * self.params.step_tokens
        peer.trained_total += peer.round_tokens
        peer.training_since = None
        self._publish_now(peer)
        self.tally.trained(peer.machine.round, peer.round_tokens)
        self._act(peer, Closed(self._facts(peer, self._fresh())))

    def _act(self, peer: Peer, event: Any) -> None:
        settings = self.params.private_machine if peer.traits.private else self.params.public_machine
        peer.machine, actions = machine.transition(peer.machine, event, settings)
        self.tally.transitions += 1
        self._perform(peer, actions)

    def _perform(self, peer: Peer, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Record):
                self.tally.outcome(peer, action.outcome, self.queue.now)
            elif isinstance(action, Apply):
                pass  # the new step and θ label are set where the group's result is known
        command = actions[-1]
        if isinstance(command, Average):
            self._seek(peer)
        elif isinstance(command, Download):
            self._resync(peer, command.min_step)
        elif isinstance(command, Train):
            self._train(peer)

    # ---- matchmaking and the all-reduce ----------------------------------------------------------------
    def _seek(self, peer: Peer) -> None:
        index = peer.machine.round
        book = self.rounds.get(index)
        if book is None or book.over:  # the first try of this round, or a retry after its groups failed
            book = self.rounds[index] = RoundBook(index, attempt=0 if book is None else book.attempt + 1)
        if book.settled:  # its round's groups formed already: nobody is left to meet it
            attempt = Attempt(found_group=False, seconds=self.params.cfg.averaging.matchmaking_timeout)
            self.queue.after(attempt.seconds, lambda: self._averaged(peer.peer_id, attempt, None))
            return
        if not book.seekers:  # hivemind's matchmaking gives up after its timeout: the group forms by then
            self.queue.after(
                self.params.cfg.averaging.matchmaking_timeout, lambda: self._maybe_match(book, force=True)
            )
        prepare = self.params.size.elements * PREPARE_SECONDS_PER_ELEMENT
        t = peer.traits
        book.seekers[peer.peer_id] = Seeker(
            peer.peer_id, self.queue.now + prepare, not t.private, True, t.rtt, t.up
        )
        self._maybe_match(book)

    def _maybe_match(self, book: RoundBook, force: bool = False) -> None:
        """Once every live peer of the round is in matchmaking (or gone), the groups form; at the latest when
        the first one's matchmaking timeout ends (`force`)."""
        if book.settled:
            return
        waiting = [
            p for p in self.peers.values()
            if p.alive and p.machine.round == book.index and p.peer_id not in book.seekers
            and (p.training_since is not None or p.joining is not None)
        ]  # fmt: skip
        if waiting and not force:
            return
        book.settled = True
        live = [s for s in book.seekers.values() if self.peers[s.peer_id].alive]
        if not live:
            return
        book.live_at_close = len(live)
        arrival = sorted(s.at for s in live)[len(live) // 2]
        aux = Seeker(BOOTSTRAP, arrival, True, False, 0.02, self.scenario.bootstrap_mbit * MBIT)
        avg = self.params.cfg.averaging
        target = clock.group_target(len(live), 1, max(self.peers[s.peer_id].last_group for s in live))
        window = matchmaking_window(
            avg.min_matchmaking_time, target, avg.matchmaking_timeout, avg.request_timeout
        )
        rules = Rules(
            target, window, avg.matchmaking_timeout, avg.min_group_size, self._size() + 1, TICKET_BYTES
        )
        groups, alone = form_groups([*live, aux], rules)
        self.tally.round_groups(book.index, groups, len(live))
        book.open_groups = len(groups)
        for number, group in enumerate(groups):
            self._exchange(book, number, group)
        for seeker in alone:
            if seeker.peer_id != BOOTSTRAP:
                attempt = Attempt(found_group=False, seconds=avg.matchmaking_timeout)
                self.queue.at(
                    seeker.at + avg.matchmaking_timeout,
                    lambda s=seeker, a=attempt: self._averaged(s.peer_id, a, None),
                )

    def _exchange(self, book: RoundBook, number: int, group: Group) -> None:
        index = book.index
        members = [
            costs.Member(s.peer_id, self._mode(s), s.up, s.up if s.peer_id == BOOTSTRAP else self.peers[s.peer_id].traits.down, s.rtt)
            for s in group.members
        ]  # fmt: skip
        avg = self.params.cfg.averaging
        exchange = costs.all_reduce(
            members, self.params.delta_bytes, self.params.size.elements, avg.group_size, self.params.topk
        )
        trainers = [s for s in group.members if s.trainer]
        deadline = min(self.peers[s.peer_id].deadlines.allreduce for s in trainers)
        ok = exchange.seconds <= deadline
        ends = group.begins + (exchange.seconds if ok else deadline)
        label = f"r{index}a{book.attempt}g{number}"
        self.tally.exchange(exchange, group, ok)

        def done() -> None:
            dead = [r for r in exchange.reducers if r != BOOTSTRAP and not self.peers[r].alive]
            complete = ok and not dead
            for s in group.members:
                sent, received = exchange.traffic[s.peer_id]
                if s.peer_id == BOOTSTRAP:
                    self.coordinator.reduced(sent, received)
                    continue
                self.tally.allreduce_bytes(s.peer_id, sent + received)
                peer = self.peers[s.peer_id]
                matchmaking = group.begins - s.at
                self._learn(
                    peer, complete, matchmaking, exchange.seconds, max(sent, received), len(group.members)
                )
                attempt = Attempt(
                    found_group=True, complete=complete, in_majority=True, has_average=complete,
                    majority_size=len(trainers), contributors=len(trainers), group_size=len(trainers),
                    seconds=ends - s.at, error=None if complete else "all-reduce timed out",
                )  # fmt: skip
                self._averaged(s.peer_id, attempt, label if complete else None)
            book.open_groups -= 1
            self.tally.group_done(index, exchange, complete)
            if complete:
                scorers = [s.peer_id for s in trainers if not self.peers[s.peer_id].traits.private]
                table = assign_scorers(label, scorers, [s.peer_id for s in trainers])
                self.tally.scored(table, self.params.delta_bytes)

        self.queue.at(ends, done)

    def _mode(self, seeker: Seeker) -> AveragingMode:
        if seeker.peer_id == BOOTSTRAP:
            return AveragingMode.AUX
        return AveragingMode.CLIENT if self.peers[seeker.peer_id].traits.private else AveragingMode.NODE

    def _learn(
        self, peer: Peer, complete: bool, matchmaking: float, seconds: float, nbytes: float, group: int
    ) -> None:
        """What peers/group.py's `_learn` / `_measured` tell the deadlines after a round (its rule, here)."""
        rule_size = self.params.size
        reducers = self.params.cfg.averaging.group_size  # GroupAverager's `max_reducers`
        if complete:
            peer.deadlines.observe(matchmaking, seconds)
            peer.link.observe(nbytes, seconds)
            if peer.link.measured:
                peer.deadlines.set_allreduce_ceiling(
                    allreduce_deadline(rule_size, group, peer.link.rate, reducers)
                )
        elif not peer.link.measured:
            peer.link.timed_out()
            target = max(group, self.params.cfg.averaging.group_size + 1)
            peer.deadlines.set_allreduce_ceiling(
                allreduce_deadline(rule_size, target, peer.link.rate, reducers)
            )

    def _averaged(self, peer_id: str, attempt: Attempt, label: str | None) -> None:
        peer = self.peers[peer_id]
        if not peer.alive:
            return
        before = peer.machine.step
        self._act_averaged(peer, attempt, label, before)

    def _act_averaged(self, peer: Peer, attempt: Attempt, label: str | None, before: int) -> None:
        settings = self.params.private_machine if peer.traits.private else self.params.public_machine
        event = Averaged(attempt, self._facts(peer, self._fresh()))
        peer.machine, actions = machine.transition(peer.machine, event, settings)
        self.tally.transitions += 1
        if any(isinstance(a, Apply) for a in actions):
            peer.previous = (before, peer.sha)
            peer.sha = label or f"{peer.sha}+{peer.peer_id}"
            peer.last_group = attempt.majority_size
            self.tally.applied(peer, label, peer.pending_tokens + peer.round_tokens, before, self.queue.now)
            peer.pending_tokens = 0
        else:
            peer.pending_tokens += peer.round_tokens  # Keep: its progress waits for a later round
        peer.round_tokens = 0
        self._perform(peer, actions)

    # ---- re-syncs and joins ----------------------------------------------------------------------------
    def _resync(self, peer: Peer, min_step: int) -> None:
        """Announce the download (the run's clock holds its round for it), download from public trainers."""
        now = self.queue.now
        records = self._fresh()
        run_step = facts.run_step(records)
        peer.joining, peer.joining_since, peer.training_since = max(run_step, min_step), now, None
        self._publish_now(peer)
        uplinks = {
            p.peer_id: p.traits.up
            for p in self.peers.values()
            if p.alive and not p.traits.private and p is not peer
        }
        state_bytes = int(self.params.size.state_bytes)
        found = download_seconds(records, min_step, state_bytes, peer.traits.down, uplinks, self.rng)
        lookup = costs.lookup_seconds(self._size(), peer.traits.rtt)
        self.tally.dht(
            peer.peer_id, costs.read_messages(self._size()), costs.read_bytes(self._size(), len(records), 300)
        )
        if found is None:
            self.queue.after(
                self.params.cfg.averaging.state_timeout, lambda: self._synced(peer, False, peer.machine.step)
            )
            return
        seconds, donors = found
        self.tally.state_download(state_bytes, seconds)
        step = max(int(r["outer_step"]) for r in records if r["peer_id"] in donors)
        self.queue.after(lookup + seconds, lambda: self._synced(peer, True, step))

    def _synced(self, peer: Peer, adopted: bool, step: int) -> None:
        if not peer.alive:
            return
        if adopted:
            holder = next((r for r in self._fresh() if r["outer_step"] == step), None)
            peer.sha = holder["global_sha256"] if holder else peer.sha
        peer.joining = peer.joining_since = None
        if adopted:  # the driver's `_reopen`: it joins the run's round under way, opened when the run says
            peer.round_opened, peer.opened_round = self._run_opened(peer, step), step
        event = Synced(adopted, step, self._facts(peer, self._fresh()))
        settings = self.params.private_machine if peer.traits.private else self.params.public_machine
        peer.machine, actions = machine.transition(peer.machine, event, settings)
        self.tally.transitions += 1
        self._perform(peer, actions)
        for book in list(self.rounds.values()):
            self._maybe_match(book)

    def _join(self, peer: Peer) -> None:
        """A new peer: dial-back and manifest from the bootstrap, its DHT's first lookups, then the state."""
        self.coordinator.joined()
        setup = 2 * costs.lookup_seconds(self._size(), peer.traits.rtt) + 2 * peer.traits.rtt
        self.tally.dht(
            peer.peer_id, 2 * costs.read_messages(self._size()), 2 * costs.read_bytes(self._size(), 0, 0)
        )
        self.queue.after(setup, lambda: self._resync(peer, 0))

    # ---- churn -----------------------------------------------------------------------------------------
    def _next_churn(self) -> float:
        rate = self.scenario.churn / 100.0 / 3600.0 * max(1, self._size())
        return self.queue.now + self.rng.expovariate(rate)

    def _churn(self) -> None:
        """One peer leaves (half crash, half exit cleanly: both stop publishing and renewing leases), and one
        new peer starts joining, so the run keeps its size."""
        live = sorted(p.peer_id for p in self.peers.values() if p.alive)
        gone = self.peers[self.rng.choice(live)]
        lost = self._tokens_now(gone, self.queue.now) if gone.training_since is not None else 0
        self._account_alive(gone)
        gone.alive = False
        self.live -= 1
        self.tally.left(gone.peer_id, crashed=self.rng.random() < 0.5, lost=lost)
        traits = draw_traits(self.rng, self.scenario, self.joined)
        self.joined += 1
        self._start(traits, self.queue.now, joiner=True)
        self.tally.joiners.add(traits.peer_id)
        for book in list(self.rounds.values()):
            self._maybe_match(book)
        self.queue.at(self._next_churn(), self._churn)

    def _account_alive(self, peer: Peer) -> None:
        if peer.alive:
            peer.alive_seconds = self.queue.now - peer.started
            if peer.training_since is not None:
                peer.train_seconds += self.queue.now - peer.training_since
                peer.training_since = None


def simulate(scenario: Scenario) -> dict[str, Any]:
    return Simulation(scenario).run()
