"""The run manifest: the settings every participant of a run shares, signed by the node that issued it.

- `keys.py`: which config keys are run-wide and which are this machine's own;
- `record.py`: the manifest as a value (issue, sign, encode, decode, verify, hash);
- `adopt.py`: running with it (the run's keys over ours, contradictions named) and whom to trust (pure);
- `obtain.py`: which manifest a starting node runs with and where it keeps it;
- `book.py`: the run's manifests in the DHT.
"""
