"""What every subcommand shares: argument types that explain a bad value in one line, and the exit codes.

Every user error is one line on stderr (`dilocod: error: …`) and exit code 2; a network failure exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USAGE = 2
EXIT_NETWORK = 1
EXIT_INTERRUPTED = 130

N = TypeVar("N", int, float)


def _bounded(
    kind: Callable[[str], N], what: str, fits: Callable[[N], bool], why_not: Callable[[N], str]
) -> Callable[[str], N]:
    """An argparse type: `text` read as `kind`, kept if it `fits`, else one line: what it is not, or why not."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(why_not(value))
        return value

    return parse


port = _bounded(
    int, "a port number", lambda v: 0 <= v <= 65535, lambda v: f"port {v} is out of range 0..65535"
)
seconds = _bounded(
    float,
    "a number of seconds",
    lambda v: 0.1 <= v <= 3600,
    lambda v: f"{v:g} seconds is out of range 0.1..3600",
)
count = _bounded(int, "a whole number", lambda v: v >= 0, lambda v: f"{v} is negative")
temperature = _bounded(float, "a number", lambda v: 0 <= v <= 100, lambda v: f"{v:g} is out of range 0..100")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print `message` (a line per problem, e.g. one per contradicted key) and return `code`."""
    for line in message.splitlines() or [""]:
        print(f"dilocod: error: {line}", file=sys.stderr)
    return code
