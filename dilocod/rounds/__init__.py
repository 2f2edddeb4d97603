"""The round protocol: the run's clock, the pure round machine, and the driver that performs its actions.

- `clock.py`: when the run's round closes, from the peers' published progress (pure);
- `events.py`, `machine.py`, `reasons.py`: the transition function (state, event) → actions (pure);
- `facts.py`: what the run's status records say relative to us (pure);
- `tokens.py`: the tokens behind our contribution, and how many reached θ_global (pure bookkeeping);
- `pipeline.py`: the tensor side of a round for every overlap mode (runs in the trainer thread);
- `ports.py`: the small protocols the daemon hands the driver (training, averaging, state sync, run
  view, publisher); `driver.py` runs the machine through them, with `effects.py` (what a decision does),
  `exchange.py` (a round's averaging: ticket, group, outcome), `joining.py` (a re-sync announced to the
  run's clock), `timing.py` (the clock while training) and `observe.py` (reading the run for a decision).
- `settings.py`: the few run settings these read (`RoundSettings`), built by the node from its config;
- `phases.py`: where the seconds between two stretches of inner steps go; `helperclock.py`: the reducing
  helper's view of the run's clock.
Nothing here imports the node (`dilocod.node`) or the config: `make lint` checks it (docs/architecture.md).
"""
