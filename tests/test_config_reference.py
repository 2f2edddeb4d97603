"""docs/configuration.md is what `dilocod config --reference` prints, and every config key has a line."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dilocod.config_reference import REGENERATE, field_docs, missing_docs, reference
from tests.tools import REPO, run_main


def test_every_config_key_is_documented_in_the_code() -> None:
    missing = missing_docs()
    assert not missing, (
        f"config keys without a comment on or above their field: {', '.join(missing)}; "
        f"write one, then regenerate the reference: {REGENERATE}"
    )


def test_docs_configuration_md_is_current() -> None:
    on_disk = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert on_disk == reference(), f"docs/configuration.md is out of date; regenerate it: {REGENERATE}"


def test_the_command_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    from dilocod.cli import main

    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == reference()


def test_the_command_needs_reference(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "config")
    assert code == 2 and "--reference" in err


@dataclass(frozen=True)
class _Sample:
    """`[sample]`: comments in all the places a field's may be."""

    # above, first line
    # above, second line
    above: int = 1
    trailing: str = "x"  # on its own line
    wrapped: str = (
        "a default long enough to be wrapped"  # inside the parentheses the formatter wraps a long line in
    )
    # one above
    both: float = 0.5  # and a trailing one
    undocumented: bool = False

    # a comment after a blank line belongs to the next field only
    after_blank: tuple[str, ...] = field(default=())  # fmt: skip


def test_field_docs_reads_every_place_a_comment_may_be() -> None:
    docs = field_docs(_Sample)
    assert docs["above"] == "above, first line above, second line"
    assert docs["trailing"] == "on its own line"
    assert docs["wrapped"] == "inside the parentheses the formatter wraps a long line in"
    assert docs["both"] == "one above and a trailing one"
    assert docs["undocumented"] == ""
    assert docs["after_blank"] == "a comment after a blank line belongs to the next field only"
