"""Reading the documentation's Markdown, for the tests of README.md and docs/ (tests/test_docs*.py):
the pages, the command blocks a guide marks as tested (`<!-- tested -->`, or `<!-- tested: serves -->`
for a block that starts a service), and the links and #anchors GitHub makes of them."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from support import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
# Where else the documentation links: each service's README and the manifests'.
READMES = sorted([*(REPO / "services").glob("*/README.md"), REPO / "k8s" / "README.md"])
MARK = "<!-- tested -->"
SERVES = "<!-- tested: serves -->"  # a block that starts a service and leaves it running
FENCE = re.compile(r"^(```+|~~~+)")


@dataclasses.dataclass(frozen=True)
class Block:
    """A command block a guide marks as tested: the line of its fence, its text, and whether it
    starts a service that runs until stopped."""

    line: int
    text: str
    serves: bool = False


# ---- reading Markdown --------------------------------------------------------------------------------
def marked_blocks(path: pathlib.Path) -> list[Block]:
    """Each command block marked as tested, in the order of the file."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() not in (MARK, SERVES):
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence.strip() in ("```sh", "```bash"), \
            f"{path.name}:{i + 1}: {line.strip()} must stand right before a ```sh block, not {fence!r}"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append(Block(i + 2, "\n".join(lines[i + 2:end]), line.strip() == SERVES))
    return out


def unfenced(text: str) -> list[str]:
    """The lines outside fenced blocks (where a `#` starts a comment, not a heading)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def anchors(path: pathlib.Path) -> set[str]:
    """The #anchors GitHub gives the headings of a Markdown file."""
    out: set[str] = set()
    for line in unfenced(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in out:
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def links(path: pathlib.Path) -> list[str]:
    """The targets of the Markdown links and images outside code."""
    text = "\n".join(re.sub(r"`[^`]*`", "", line) for line in unfenced(path.read_text()))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
