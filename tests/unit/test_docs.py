"""The README and docs/: every repository path they cite exists, and their lines stay of ordinary length.

A doc that names a file the repository does not hold (a console log never committed, a script since
renamed) sends a reader nowhere; docs/CONVENTIONS.md sets the line lengths checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/*/README.md")])
# Backquoted paths under these folders (or these top-level files) must exist in the repository.
TOP = ("roles/", "scripts/", "tests/", "docs/", "templates/", "group_vars/", "playbooks/", "inventory/",
       "molecule/", "patches/", "filter_plugins/", "library/", ".ci/")
TOP_FILES = {"site.yml", "Makefile", "requirements.txt", "ansible.cfg", "pyproject.toml"}
PROSE_MAX = 120
TABLE_MAX = 200
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> a/b.py, a/c.py; `<method>` placeholders and `*` become glob wildcards."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]
    return [re.sub(r"<[^>]+>", "*", path)]


def cited_paths(text: str, doc_dir: Path) -> list[str]:
    """Repository paths a doc (in ``doc_dir``, inside ROOT) cites: backquoted ones under TOP (or TOP_FILES)
    and relative links."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for token in CODE.findall(text):
        token = re.sub(r":\d[\d-]*$", "", token.rstrip(".,;:"))
        if " " not in token and (token.startswith(TOP) or token in TOP_FILES):
            out.append(token)
    for link in LINK.findall(text):
        if "://" not in link and not link.startswith("mailto:"):
            out.append(str((doc_dir / link).resolve().relative_to(ROOT)))
    return out


def missing(text: str, doc_dir: Path) -> list[str]:
    return [p for p in cited_paths(text, doc_dir) if not all(any(ROOT.glob(q)) for q in _expand(p))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc: Path) -> None:
    text = doc.read_text()
    assert cited_paths(text, doc.parent), f"{doc.name}: no path found at all: the parser is broken"
    gone = missing(text, doc.parent)
    assert not gone, f"{doc.relative_to(ROOT)} cites paths the repository does not hold: {gone}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lines_of_ordinary_length(doc: Path) -> None:
    long = [(i, len(line)) for i, line in enumerate(doc.read_text().splitlines(), 1)
            if len(line) > (TABLE_MAX if line.startswith("|") else PROSE_MAX)]
    limits = f"over {PROSE_MAX} characters ({TABLE_MAX} in tables)"
    assert not long, f"{doc.relative_to(ROOT)}: lines (number, length) {limits}: {long}"


def test_the_checker_can_fail() -> None:
    """Negative control: an absent file, a missing link and a missing brace alternative are caught."""
    text = ("See `docs/gpu-e2e/2026-11-30-run3-console.log`, [x](nowhere.md),\n"
            "`tests/unit/test_{docs,nodoc}.py`; `scripts/bench.py`, [the guide](../README.md) and\n"
            "`roles/<role>/README.md` exist.\n")
    assert missing(text, ROOT / "docs") == [
        "docs/gpu-e2e/2026-11-30-run3-console.log", "tests/unit/test_{docs,nodoc}.py", "docs/nowhere.md"]
