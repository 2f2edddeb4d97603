"""`dilocod config --reference`: every config key by section (docs/configuration.md), offline."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dilocod.commands.args import fail


def add_parser(sub: Any) -> None:
    config = sub.add_parser("config", help="print the configuration reference (docs/configuration.md)")
    config.add_argument(
        "--reference",
        action="store_true",
        required=True,
        help="every key by section: type, default, run-wide or local, what it does (from the code)",
    )


def run(args: argparse.Namespace) -> int:
    from dilocod.config_reference import MissingDocs, reference

    try:
        sys.stdout.write(reference())
    except MissingDocs as e:
        return fail(str(e))
    return 0
