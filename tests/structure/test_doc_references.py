"""Every document the code cites by name ships with the repository: a bare ``name.md`` resolves
to a page under ``docs/`` (or a top-level file such as ``CHANGELOG.md``), a path
(``bench/README.md``) to that file, and a quoted section after it ("Canonical scope shape") to a
heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

from ._source import SRC

ROOT = SRC.parent.parent
_CITED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w.-]+\.md)\b(?:,?\s+\"([^\"]+)\")?")


def _citations() -> list[tuple[str, str, str | None]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        for match in _CITED.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1), match.group(2)))
    return found


def _resolve(name: str) -> Path | None:
    if "/" in name:
        return ROOT / name if (ROOT / name).is_file() else None
    pages = sorted((ROOT / "docs").rglob(name))
    if pages:
        return pages[0]
    return ROOT / name if (ROOT / name).is_file() else None


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]


def test_the_code_cites_the_format_documents() -> None:
    names = {name for _, name, _ in _citations()}
    assert {"spool-format-v1.md", "telemetry-event-v3.md", "heartbeat-jsonl.md"} <= names


def test_every_cited_document_resolves_inside_the_repository() -> None:
    missing = [f"{where}: {name}" for where, name, _ in _citations() if _resolve(name) is None]
    assert missing == []


def test_every_cited_section_is_a_heading_of_its_page() -> None:
    missing = []
    for where, name, section in _citations():
        page = _resolve(name)
        if section is None or page is None:
            continue
        if not any(section.lower() in heading.lower() for heading in _headings(page)):
            missing.append(f"{where}: {name} \"{section}\"")
    assert missing == []


_REPO_PATH = re.compile(r"(?<![\w/.-])((?:src|tests|bench|docs|examples)/[\w./-]+\.(?:py|md))\b")


def test_every_repository_path_the_code_and_docs_name_exists() -> None:
    """A reader follows ``tests/structure/test_guard.py`` from a docstring; it must be there."""
    texts = [*SRC.rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *(ROOT / "bench").glob("*.py")]
    missing = [f"{path.relative_to(ROOT)}: {name}" for path in texts
               for name in _REPO_PATH.findall(path.read_text()) if not (ROOT / name).exists()]
    assert missing == []


def test_nothing_cites_the_teams_notes_outside_the_repository() -> None:
    """Comments once pointed at a style page that is not in the repository ("STYLE habit 13")."""
    texts = [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*"), *(ROOT / "docs").rglob("*.md")]
    outside = re.compile(r"STYLE(?:\.md| habit)|\.\./shared|DESIGN\.md")
    cited = [str(path.relative_to(ROOT)) for path in texts
             if path.is_file() and path.suffix in {".py", ".md"} and path.name != "test_doc_references.py"
             and outside.search(path.read_text())]
    assert cited == []
