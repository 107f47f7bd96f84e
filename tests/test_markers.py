"""The suite's parts: each test is exactly one of core, processes, faults or security, so `pytest -m core`
and the others split it without gaps or overlaps. conftest.py fails collection otherwise; these tests
check that rule, its registration in pyproject.toml, and that it catches a test added without a kind."""

from __future__ import annotations

import textwrap
import tomllib

import pytest

from .conftest import KINDS, ROOT, kinds_of

pytestmark = pytest.mark.core


def ini_options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def test_the_four_kinds_are_registered_with_a_description_and_marks_are_strict():
    registered = dict(line.split(":", 1) for line in ini_options()["markers"])
    assert set(KINDS) <= set(registered)
    assert all(registered[kind].strip() for kind in KINDS)
    assert "--strict-markers" in ini_options()["addopts"].split()


def test_every_collected_test_has_exactly_one_kind(request: pytest.FixtureRequest):
    wrong = [(item.nodeid, kinds_of(item)) for item in request.session.items if len(kinds_of(item)) != 1]
    assert wrong == []


def test_a_test_with_no_kind_or_two_fails_collection(pytester: pytest.Pytester):
    markers = "\n".join(f"    {line}" for line in ini_options()["markers"])
    pytester.makeini(f"[pytest]\naddopts = --strict-markers\nmarkers =\n{markers}\n")
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makepyfile(
        test_new=textwrap.dedent(
            """
            import pytest

            @pytest.mark.core
            def test_one_kind(): pass

            def test_forgot_its_kind(): pass

            @pytest.mark.core
            @pytest.mark.faults
            def test_two_kinds(): pass
            """
        )
    )
    res = pytester.runpytest_inprocess("--collect-only", "-q", "-m", "core")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(
        ["*every test needs exactly one of the marks core, processes, faults, security*",
         "*test_new.py::test_forgot_its_kind: none", "*test_new.py::test_two_kinds: core, faults"]
    )  # fmt: skip
    assert "test_one_kind" not in res.stderr.str()
