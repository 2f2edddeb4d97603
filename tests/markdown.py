"""Just enough markdown for the docs tests: fenced code blocks, links outside code, headings' anchors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    text: str


@dataclass(frozen=True)
class Link:
    file: Path
    line: int
    target: str


def _lines_outside_code(text: str) -> Iterator[tuple[int, str]]:
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match and (fence is None or match.group(1) == fence):
            fence = match.group(1) if fence is None else None
            continue
        if fence is None:
            yield number, line


def code_blocks(text: str) -> list[Block]:
    """Every fenced code block, with its language tag ("" when none)."""
    blocks: list[Block] = []
    lang: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match and lang is None:
            lang, lines = match.group(2), []
        elif match and lang is not None:
            blocks.append(Block(lang, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def links(path: Path) -> list[Link]:
    """Every inline link of `path` outside code (images left out)."""
    found = []
    for number, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            found.append(Link(path, number, match.group(1)))
    return found


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of `path`: lower case, punctuation dropped, spaces to
    hyphens, `-1`, `-2`, … for repeats."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for _, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result
