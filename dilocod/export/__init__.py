"""A run's model for the Hugging Face world: export as a Llama checkpoint, import one back, sample text.

Only `dilocod/cli.py` imports this package (docs/model.md).
"""
