"""Every relative link of README.md, CHANGELOG.md and docs/*.md reaches a file, and its #anchor a heading."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.markdown import anchors, links
from tests.tools import REPO

PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
_EXTERNAL = ("http://", "https://", "mailto:")


def broken(page: Path) -> list[str]:
    problems = []
    for link in links(page):
        if link.target.startswith(_EXTERNAL):
            continue
        where = f"{page.relative_to(REPO)}:{link.line}: ({link.target})"
        path_text, _, anchor = link.target.partition("#")
        target = (page.parent / unquote(path_text)).resolve() if path_text else page
        if not target.exists():
            problems.append(f"{where} no such file")
        elif anchor and target.suffix != ".md":
            problems.append(f"{where} an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(target):
            problems.append(f"{where} no heading with anchor #{anchor} in {target.relative_to(REPO)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page: Path) -> None:
    problems = broken(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_sees_links_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# B title\n\n## The run's clock (`x.py`)\n\n```\n# not a heading\n```\n")
    (tmp_path / "a.md").write_text(
        "[ok](b.md#the-runs-clock-xpy) [top](#a) [gone](c.md) `[code](c.md)`\n"
        "[bad](b.md#not-a-heading) [web](https://example.org/x)\n\n# A\n"
    )
    page = tmp_path / "a.md"
    targets = [link.target for link in links(page)]
    assert targets == ["b.md#the-runs-clock-xpy", "#a", "c.md", "b.md#not-a-heading", "https://example.org/x"]
    assert anchors(tmp_path / "b.md") == {"b-title", "the-runs-clock-xpy"}
