"""The one error of `dilocod export`/`generate` that is not the checkpoint's, the manifest's or the data's."""

from __future__ import annotations


class ExportError(ValueError):
    """A model or run that cannot be exported, imported or sampled from; the message is one line."""
