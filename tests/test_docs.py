"""The documentation a user reads: the README fits a screen, the generated references are what the code says,
links resolve, and no page speaks of how the project was made (which a user cannot act on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpumesh.cli import reference
from gpumesh.sandbox.launch import PASS_ENV

from .conftest import ROOT

pytestmark = pytest.mark.core

# The pages a user reads, the command-line help included (the CLI reference holds every --help, and is
# checked against the code below).
USER_DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md", ROOT / "workers" / "README.md"]


def user_docs() -> list[Path]:
    return USER_DOCS + sorted((ROOT / "docs").rglob("*.md"))


# Words about how the project was made: its sessions and rounds of work, issue numbers, its versions by order,
# the machines by when they were used, the dates of runs, a design file that is not in the repository.
HISTORY = [
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|last|this|that|previous|earlier|whole)"
    r" (security )?(session|round)s?\b",
    r"\bissues? #?\d+",
    r"\b(first|second|third) version\b",
    r"\bfound in (review|work)\b",
    r"\b20\d\d-\d\d-\d\d\b",
    r"\b(last|previous|earlier|first|second|third|fourth|fifth|sixth|slow|fast|idle|busy) (2-core )?VMs?\b",
    r"\bthe VMs? (named|before|goes)\b|\bas the VM goes\b",
    r"\bDESIGN(\.md| §)",
]
HISTORY_RE = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)


def history_words(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY_RE.finditer(text)]


def test_no_user_doc_or_help_text_speaks_of_how_the_project_was_made():
    found = []
    for path in user_docs():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {w!r}" for w in history_words(line)]
    found += [f"--help: {w!r}" for w in history_words(reference.render())]
    assert found == [], "state facts as they are now; name a machine by what it is (CPU, speed)"
    # what the check catches, and what it leaves alone
    assert history_words("on the fifth session's VM, 2026-12-05, the first version; issue 18; in this round")
    assert not history_words("each attempt runs in its own process session; 3 rounds; an older version; a cloud VM")


def test_the_cli_and_settings_reference_is_what_the_code_prints():
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert committed == reference.render(), (
        "docs/reference/cli.md is stale: python -m gpumesh.cli.reference cli > docs/reference/cli.md"
    )


def test_the_python_api_reference_is_what_the_docstrings_say():
    committed = (ROOT / "docs" / "reference" / "python-api.md").read_text()
    assert committed == reference.render_python_api(), (
        "docs/reference/python-api.md is stale: python -m gpumesh.cli.reference python > docs/reference/python-api.md"
    )


def test_the_readme_fits_a_screen_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    run = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[server]' && .venv/bin/gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2"
    tests = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -n 2"
    assert run in readme and tests in readme
    assert tests.split(" && ")[-1] in (ROOT / ".ci" / "run").read_text()  # what CI runs is what the README says


LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")
FENCED = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-"))
    return found


def test_every_relative_link_in_the_docs_reaches_a_file_and_its_heading():
    broken = []
    for path in user_docs():
        prose = FENCED.sub("", path.read_text())  # a code example's brackets are no link
        for target, anchor in LINK.findall(prose):
            if "://" in target or target.startswith("mailto:"):
                continue
            page = (path.parent / target) if target else path
            if not page.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and page.suffix == ".md" and anchor[1:] not in anchors(page):
                broken.append(f"{path.relative_to(ROOT)}: {target}{anchor}")
    assert broken == []


def test_the_task_environment_page_names_every_variable_a_task_gets_from_its_worker():
    page = (ROOT / "docs" / "reference" / "task-environment.md").read_text()
    assert [v for v in PASS_ENV if f"`{v}`" not in page] == []
