"""The README stays short and complete, and every link in the documentation leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_queue.cli import main

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"^#{1,6} (.*)$", line)):
            found.add(slug(match.group(1)))
    return found


def test_the_readme_is_short_and_lists_every_command():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    table = [line for line in text.splitlines() if line.startswith("| `dflash-queue ")]
    listed = {line.split()[2].rstrip("`") for line in table}
    assert listed == set(main.commands), f"README command table: {sorted(listed)} vs CLI {sorted(main.commands)}"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for document in DOCUMENTS:
        for target in LINK.findall(document.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, anchor = target.partition("#")
            path = (document.parent / file_part).resolve() if file_part else document
            if not path.exists():
                broken.append(f"{document.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{document.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []
