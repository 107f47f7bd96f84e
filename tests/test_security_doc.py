"""SECURITY.md names, for every protection and every attack, the test that shows it: each of those tests exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parent.parent


def named_tests() -> list[tuple[str, str]]:
    """(file, test) for every `file.py::test` and `…::test` (the previous file's) SECURITY.md names."""
    found, current = [], ""
    for ref in re.findall(r"`((?:test_\w+\.py|…)::\w+)`", (ROOT / "SECURITY.md").read_text()):
        file, _, name = ref.partition("::")
        current = current if file == "…" else file
        found.append((current, name))
    return found


def test_every_test_security_md_names_exists():
    refs = named_tests()
    assert len(refs) >= 30
    missing = [
        f"{file}::{name}"
        for file, name in refs
        if not re.search(rf"^def {name}\(", next((ROOT / "tests").rglob(file)).read_text(), re.MULTILINE)
    ]
    assert not missing, missing
