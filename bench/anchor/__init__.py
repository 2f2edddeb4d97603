"""The race against the anchor (`bench/anchor_hivemind.py`): the stock `hivemind.Optimizer` with local
updates against dilocod's defaults, on the same model, corpus, batches, peers and machine."""
