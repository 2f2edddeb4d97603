"""A run's model for the Hugging Face world: export as a Llama checkpoint, import one back, sample text.

Imported by the CLI's `export`, `import` and `generate` commands, by the node services that start from
an initial checkpoint or export from a running peer (`node/resume.py`, `initweights.py`,
`exportfrom.py`), and by the CLI's `join` and `bootstrap`, which pin an initial checkpoint in a new run's manifest (`pininit.py`); see
docs/model.md.
"""
