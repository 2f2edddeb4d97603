"""A transformers model in the run's manifest: the config itself, as canonical JSON (`model.hf_config_json`).

`model.hf_config = DIR` is local (a path means nothing on another machine). The node that starts the run reads
DIR/config.json, checks that it is a causal LM that transformers can build and that its vocabulary holds the
run's tokenizer, and writes the config as canonical JSON (sorted keys, no spaces) into the run-wide settings
it signs. So the manifest's hash pins the architecture by content (the config's own sha256 names it in the
run's summary), and a joiner builds the model from the manifest without the directory. A joiner that sets
`model.hf_config` too must name the same config.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dilocod.config import Config, ConfigError
from dilocod.manifest.record import canonical, settings_of
from dilocod.trainer.hfmodel import HFConfigError, config_vocab, parse_hf_config
from dilocod.trainer.lm import hf_config_sha256

CONFIG_FILE = "config.json"
SETTINGS_MAX = 12000  # proto.MANIFEST's settings field, in characters


def read_config_dir(directory: Path) -> str:
    """The canonical JSON of `directory`/config.json (ConfigError, one line, for a missing or bad file)."""
    if not directory.is_dir():
        raise ConfigError(f"model.hf_config: {directory}: no such directory")
    path = directory / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"model.hf_config: {directory} holds no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"model.hf_config: cannot read {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    return canonical_config(text, f"model.hf_config: {path}")


def canonical_config(text: str, where: str) -> str:
    """`text` (a config.json) as canonical JSON, checked to be a causal LM's config."""
    try:
        parse_hf_config(text, where)
        return canonical(json.loads(text))
    except HFConfigError as e:
        raise ConfigError(str(e)) from None


def pin_hf_config(config: Config, tokenizer_vocab: int) -> Config:
    """`config` with the transformers config its `model.hf_config` names pinned in `model.hf_config_json`."""
    model = config.model
    if not model.hf_config:
        if model.hf_config_json:  # set as a run-wide key directly: it must still be a causal LM's config
            pinned = canonical_config(model.hf_config_json, "model.hf_config_json")
            return _checked(replace(config, model=replace(model, hf_config_json=pinned)), tokenizer_vocab)
        return config
    directory = Path(model.hf_config).expanduser()
    pinned = read_config_dir(directory)
    if model.hf_config_json and model.hf_config_json != pinned:
        raise ConfigError(
            f"model.hf_config: {directory} holds config {hf_config_sha256(pinned)[:16]}…, not "
            f"model.hf_config_json's {hf_config_sha256(model.hf_config_json)[:16]}…"
        )
    model = replace(model, hf_config=str(directory.resolve()), hf_config_json=pinned)
    return _checked(replace(config, model=model), tokenizer_vocab)


def _checked(config: Config, tokenizer_vocab: int) -> Config:
    vocab = config_vocab(parse_hf_config(config.model.hf_config_json))
    if vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.hf_config: vocab_size {vocab} is smaller than the run's tokenizer's {tokenizer_vocab} "
            "tokens; set vocab_size in config.json to at least that"
        )
    size = len(canonical(settings_of(config)))
    if size > SETTINGS_MAX:
        raise ConfigError(
            f"model.hf_config: config.json makes the run's settings {size} characters; a manifest holds "
            f"at most {SETTINGS_MAX} (drop keys left at their defaults)"
        )
    return config


def check_local_hf_config(config: Config) -> None:
    """A joiner's own `model.hf_config`, if it sets one, must be the run's pinned config."""
    model = config.model
    if not model.hf_config:
        return
    mine = read_config_dir(Path(model.hf_config).expanduser())
    if mine != model.hf_config_json:
        theirs = (
            hf_config_sha256(model.hf_config_json)[:16] if model.hf_config_json else "none (model.preset)"
        )
        raise ConfigError(
            f"model.hf_config: {model.hf_config} holds config {hf_config_sha256(mine)[:16]}…, "
            f"the run trains {theirs}…"
        )
