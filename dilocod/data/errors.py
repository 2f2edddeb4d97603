"""The one error type of the data side (prepare, shards, sources, tokenizers)."""

from __future__ import annotations


class DataError(Exception):
    """A data input that cannot be used; the message is one line naming the file and the problem."""


class MissingFile(DataError):
    """A file the dataset's index lists is not there (yet): fetch it, unlike a damaged one."""
