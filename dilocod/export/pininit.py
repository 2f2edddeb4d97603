"""The run's starting weights in its manifest: the sha256 of a Hugging Face Llama checkpoint's weights.

`dilocod bootstrap --init-from DIR` sets `model.init_from` (local: a path means nothing on another machine).
The node that starts the run checks the directory against the run's model (`dilocod/export/initial.py`) and
writes the sha256 of its model.safetensors into the run-wide settings it signs (`model.init`), after the
dataset is pinned, so the vocabulary it checks is the run's tokenizer's. Every peer's θ_global at outer
step 0 is then those weights (`dilocod/node/initweights.py` gets them to the peer).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dilocod.config import Config, ConfigError
from dilocod.export.errors import ExportError
from dilocod.export.initial import TOKENIZER_FILE, check_init_dir


def pin_init(config: Config) -> Config:
    """`config` with the starting weights its `model.init_from` names pinned in `model.init`."""
    model = config.model
    if not model.init_from:
        if model.init:
            raise ConfigError(
                "model.init names starting weights, but no model.init_from (--init-from) holds them"
            )
        return config
    directory = Path(model.init_from).expanduser()
    tokenizer = Path(config.data.path) / TOKENIZER_FILE if config.data.path else None
    try:
        sha = check_init_dir(directory, model.spec(), tokenizer)
    except ExportError as e:
        raise ConfigError(f"--init-from: {e}") from None
    if model.init and model.init != sha:
        raise ConfigError(
            f"--init-from: {directory} holds weights {sha[:16]}…, not model.init {model.init[:16]}…"
        )
    return replace(config, model=replace(model, init=sha, init_from=str(directory.resolve())))
