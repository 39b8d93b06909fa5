"""The documentation stands on its own: no text names a document outside the repository,
and every relative Markdown link in README.md and docs/*.md reaches a file (and, for an
`#anchor` into a .md file, one of its headings, by GitHub's anchor rule)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OUTSIDE = [
    r"\.\./shared",
    r"(?<![\w.-])shared/",
    r"DESIGN\.md",
    r"papers/00",
    r"(?i:papers README)",
    r"(?i:\bslips? \d)",
    r"(?i:the design page)",
    r"(?i:\bthe issue\b)",
]
"""Names of documents that live outside the repository (the design notes, the papers'
folder, the issue tracker): docs/design.md and docs/papers.md are the ones to cite."""

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def tracked_text_files() -> list[Path]:
    """The repository's tracked files that read as text (this test's own patterns aside)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files.append(path)
    return files


def test_no_text_names_a_document_outside_the_repository():
    pattern = re.compile("|".join(OUTSIDE))
    found = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            match = pattern.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "documents outside the repository named:\n" + "\n".join(found)


def prose(text: str, inline: bool = True) -> str:
    """`text` with fenced code blocks (and `inline` code) blanked out, line numbers kept."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            code = re.sub(r"`[^`\n]*`", "``", line) if inline else line
            lines.append("" if fenced else code)
    return "\n".join(lines)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation other than
    '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings (repeated ones numbered -1, -2, ... as GitHub does)."""
    seen: dict[str, int] = {}
    for line in prose(page.read_text(encoding="utf-8"), inline=False).splitlines():
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        anchor = github_anchor(heading.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        if count:
            seen[f"{anchor}-{count}"] = 1
    return set(seen)


def test_github_anchor_rule():
    assert github_anchor("The recipe: `vitrieval-train fit`") == "the-recipe-vitrieval-train-fit"
    assert github_anchor("LaCViT and its baseline (`fit --method lacvit | ce`)") == (
        "lacvit-and-its-baseline-fit---method-lacvit--ce"
    )
    assert github_anchor("Re-ranking: alpha-QE and DBA") == "re-ranking-alpha-qe-and-dba"


def relative_links(page: str) -> list[tuple[int, str]]:
    """(line, target) of every link in `page` that is not a URL."""
    text = prose((ROOT / page).read_text(encoding="utf-8"))
    links = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        links.append((text.count("\n", 0, match.start(1)) + 1, target))
    return links


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_reach_a_file_and_heading(page):
    source = ROOT / page
    broken = []
    for line, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        path = (source.parent / path_part).resolve() if path_part else source
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(f"{page}:{line}: {target} (no such file in the repository)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{page}:{line}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
