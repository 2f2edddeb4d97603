"""The in-process DiLoCo simulator behind `bench/simulate.py` (its docstring is the user documentation).

- `schedule.py`: each replica's inner steps per round (the run's clock, speeds, streaming's shorter rounds);
- `replica.py`: one simulated peer, built from the daemon's trainer, outer optimizer, pipeline and ledger;
- `allreduce.py`: a group's all-reduce in one process (weights, parts, codec, reducer);
- `diloco.py`: M replicas round by round in every overlap mode; `dp.py`: the data-parallel baseline;
- `settings.py`, `variants.py`: the config each variant runs with; `report.py`: rows, JSON and table;
- `overhead.py`: the simulator's speed against one replica's trainer alone.
"""
