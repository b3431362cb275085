"""Every relative link and every `path` of a repository file in README.md and docs/ resolves.

A link `[text](target)` is resolved against its document's folder; a code span that names a path
from the repository root (its first part is a top-level entry, e.g. `deployments/app.py` or
`deployments/app.py:build_app`) must name a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (commands and output, not references)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(_prose(text)) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def path_refs(text: str) -> list[str]:
    """Code spans that name a repository path: `a/b.py`, `a/b.py:symbol`, `a/b/` (not commands)."""
    out = []
    for span in CODE.findall(_prose(text)):
        candidate = span.split(":", 1)[0].rstrip("/")
        if " " in candidate or "*" in candidate or "/" not in candidate:
            continue
        if candidate.split("/", 1)[0] in TOP:
            out.append(candidate)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_resolves(doc: Path):
    text = doc.read_text()
    broken = [t for t in links(text) if not (doc.parent / t.split("#", 1)[0]).exists()]
    broken += [f"`{p}`" for p in path_refs(text) if not (ROOT / p).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: dead references {broken}"


def test_the_checks_find_what_they_look_for():
    text = "see [a](docs/x.md), [b](https://x.org), `deployments/app.py:build_app`, `pdserve serve`\n" \
           "```\n[c](nowhere.md) `engine/nowhere.py`\n```\n"
    assert links(text) == ["docs/x.md"]
    assert path_refs(text) == ["deployments/app.py"]


def test_the_readme_teaches_in_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
