"""Running with the run's manifest: its run-wide settings over this machine's local ones, and the rules that
decide whether a manifest may be trusted at all. Pure functions (table-tested in tests/test_manifest.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from dilocod.config import Config, ConfigError, config_from_raw
from dilocod.manifest.keys import RUN_WIDE, is_run_wide
from dilocod.manifest.record import Manifest, ManifestError


def conflicts(manifest: Manifest, local_raw: dict[str, Any]) -> list[str]:
    """One line per run-wide key this machine set (config file or --set) to another value than the run's:
    `averaging.compression: the run uses int8, you set none`."""
    local = config_from_raw(local_raw, validate=False)
    run = run_config(manifest, {}, validate=False)
    lines = []
    for section, keys in local_raw.items():
        if not isinstance(keys, dict):
            continue
        for key in keys:
            if not is_run_wide(section, key):
                continue
            mine, theirs = getattr(getattr(local, section), key), getattr(getattr(run, section), key)
            if mine != theirs:
                lines.append(f"{section}.{key}: the run uses {_show(theirs)}, you set {_show(mine)}")
    return lines


def run_config(manifest: Manifest, local_raw: dict[str, Any], *, validate: bool = True) -> Config:
    """The config this machine runs with: the manifest's run-wide keys, its own local ones. The manifest is
    stranger data, so it is checked like a config file (one line naming the key)."""
    raw = copy.deepcopy({s: v for s, v in local_raw.items() if isinstance(v, dict)})
    for section, values in manifest.settings.items():
        if section not in RUN_WIDE:
            raise ManifestError(f"the run's manifest has an unknown section '{section}' (a newer dilocod?)")
        for key, value in values.items():
            if not is_run_wide(section, key):
                raise ManifestError(f"the run's manifest sets '{section}.{key}', which is no run-wide key")
            raw.setdefault(section, {})[key] = value
    raw.setdefault("run", {})["id"] = manifest.run_id
    try:
        return config_from_raw(raw, validate=validate)
    except ConfigError as e:
        raise ManifestError(f"the run's manifest is not a valid config: {e}") from None


def adopt(manifest: Manifest, local_raw: dict[str, Any]) -> Config:
    """`run_config`, after refusing a local value that contradicts the run (every such key named) and a
    missing run key in a run that needs one."""
    lines = conflicts(manifest, local_raw)
    if lines:
        raise ConfigError("your settings differ from the run's manifest:\n" + "\n".join(lines))
    config = run_config(manifest, local_raw)
    if manifest.key_required and config.run.key is None:
        raise ConfigError(
            f"run '{manifest.run_id}' requires a run key: set run.key (the secret, or file:<allowed peers>)"
        )
    return config


def trust_problem(
    manifest: Manifest, served_by: str, given: Sequence[str], pinned: Manifest | None
) -> str | None:
    """Why a manifest served by `served_by` must not be adopted (None: it may).

    - A node that ran in this run before keeps its bootstrap: a manifest with other content must be signed
      by the same node as the one it stored (a manifest with the same content needs no trust: nothing
      changes).
    - A newcomer trusts the peers its user named: the manifest must be signed by one of them, or served by
      one of them (a second bootstrap serves the run's first bootstrap's manifest).
    """
    if pinned is not None and pinned.run_id == manifest.run_id:
        if manifest.hash == pinned.hash or manifest.signer == pinned.signer:
            return None
        return f"signed by {manifest.signer}, but this run's manifest was signed by {pinned.signer}"
    if manifest.signer in given or served_by in given:
        return None
    return f"signed by {manifest.signer} and served by {served_by}, none of the peers you gave"


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)
