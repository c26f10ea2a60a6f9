"""The README's and docs/' cross-references resolve.

Sections move (the README's long sections went to docs/), and a reference left behind
sends a reader nowhere. Checked here, on the files as committed:
- every relative link `[text](path)` names a file or folder that exists;
- every section named in quotes after "see" or "under" (`see "The resilient core"`) is a
  heading of the same page (a reference to another page is a link), and where the
  reference says "below" or "above", the heading is there;
- no bare "(above)" or "(below)": name what is meant;
- every file a page names as `tests/...py`, `core/...py` or the like exists (the wait
  table of docs/protocol.md names the test that shows each bound).
Pure file reads.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r'\b(?:see|under)\s+"([^"]+)"(\s+(?:below|above))?')


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def _headings(text: str) -> list[tuple[int, str]]:
    """(offset, title) of each markdown heading outside code fences."""
    out, fenced, pos = [], False, 0
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append((pos, _norm(line.lstrip("#"))))
        pos += len(line)
    return out


def broken_references(page: Path, text: str) -> list[str]:
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue  # an anchor in the page, or a URL
        if not (page.parent / target).exists():
            bad.append(f"{page.name}: link to {m.group(1)} (no such file)")
    heads = _headings(text)
    for m in SECTION_REF.finditer(text):
        name, where = _norm(m.group(1)), (m.group(2) or "").strip()
        at = [off for off, title in heads if title.startswith(name)]
        if where == "below":
            at = [off for off in at if off > m.start()]
        elif where == "above":
            at = [off for off in at if off < m.start()]
        if not at:
            bad.append(f'{page.name}: "{m.group(1)}"{" " + where if where else ""} is no heading of this page')
    for m in re.finditer(r"(?<![\w/.])((?:tests|core|baselines|experiments|fault_injection|examples|paper_figs)"
                         r"/[\w/]+\.py)\b", text):
        if not (ROOT / m.group(1)).exists():
            bad.append(f"{page.name}: names {m.group(1)}, which does not exist")
    for m in re.finditer(r"\((?:above|below)\)", text):
        bad.append(f"{page.name}: a bare {m.group(0)} near {text[max(0, m.start() - 40):m.start()]!r}")
    return bad


def test_every_reference_resolves():
    bad = [b for page in PAGES for b in broken_references(page, page.read_text())]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_moved_section():
    text = '# Page\n\n## Here\n\nsee "Here" and see "On Slurm", [gone](nowhere.md), x (below)\n'
    bad = broken_references(ROOT / "README.md", text)
    assert len(bad) == 3 and not any('"Here"' in b for b in bad), bad
    assert broken_references(ROOT / "README.md", '## A\n\nsee "A" below\n')  # A is above, not below
    assert broken_references(ROOT / "README.md", "shown by tests/test_nowhere.py\n")
    assert not broken_references(ROOT / "README.md", "shown by tests/test_docs_references.py\n")


def test_code_and_docs_cite_no_tracker_numbers_and_no_file_outside_the_repo():
    """A reader who clones the repo can follow neither an issue number nor a design file that
    is not in it: the reason is written where it is needed. (Another project's tracker, named
    with its project, is a citation and stays.)"""
    pattern = re.compile(r"DESIGN\.md|(?<!pytorch )\b[Ii]ssues? #?\d+")
    found = []
    for folder in ("core", "baselines", "experiments", "fault_injection", "examples", "paper_figs", "benchmarks",
                   "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and path != Path(__file__).resolve():
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if pattern.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    found += [f"README.md: {line.strip()[:100]}" for line in (ROOT / "README.md").read_text().splitlines()
              if pattern.search(line)]
    assert not found, "\n".join(found)
