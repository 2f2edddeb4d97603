"""What every subcommand shares: argument types that explain a bad value in one line, and the exit codes.

Every user error is one line on stderr (`dilocod: error: …`) and exit code 2; a network failure exits 1.
"""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
EXIT_NETWORK = 1
EXIT_INTERRUPTED = 130


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..65535")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} seconds is out of range 0.1..3600")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range 0..100")
    return value


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print `message` (a line per problem, e.g. one per contradicted key) and return `code`."""
    for line in message.splitlines() or [""]:
        print(f"dilocod: error: {line}", file=sys.stderr)
    return code
