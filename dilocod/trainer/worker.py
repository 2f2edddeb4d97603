"""Entry point of a local worker (rank > 0 of a multi-device peer): `python -m dilocod.trainer.worker SPEC`.

A module of its own so that `local.py` is only ever imported, never run as `__main__` (the structures
rank 0 pickles name classes of `dilocod.trainer.localgroup`).
"""

import sys

from dilocod.trainer.localgroup import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
