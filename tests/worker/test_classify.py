"""What a person reads of a failed attempt (its log's next step, rq-dashboard's one-line outcome, why a clean exit
has no result), worked out from the sandbox's answer alone: no Redis, no process."""

from __future__ import annotations

import pytest

from gpumesh.sandbox.runner import Attempt, Limits
from gpumesh.store.scripts import Outcome
from gpumesh.worker import classify

pytestmark = pytest.mark.core


def ended(returncode: int | None = 0, last_line: str | None = None, killed: str | None = None) -> Attempt:
    return Attempt(returncode=returncode, last_line=last_line, killed=killed)


def test_a_clean_exit_without_a_json_last_line_says_why_it_has_no_result():
    limits = Limits(timeout=10, memory_bytes=0, result_bytes=1000)
    assert classify.bad_result(ended(last_line='{"ok": 1}'), limits) is None
    assert (
        classify.bad_result(ended(), limits)
        == "the script printed nothing; the result must be the last stdout line, as JSON"
    )
    assert classify.bad_result(ended(last_line="done!"), limits) == "the last stdout line is not JSON: 'done!'"
    assert "cannot be used" in str(classify.bad_result(ended(last_line="NaN"), limits))
    too_large = ended(last_line="1")
    too_large.result_too_large = True
    assert classify.bad_result(too_large, limits) == "result line is over the 1000-byte cap"


def test_the_dashboard_outcome_is_one_line_saying_what_happens_next():
    error = "exit code 1\nTraceback (most recent call last):\n  File 't.py'\nValueError: bad lr\n"
    assert classify.outcome("queued", error) == {
        "outcome": "failed",
        "error": "exit code 1: ValueError: bad lr",
        "next": "queued for another attempt",
    }
    assert classify.outcome("done") == {"outcome": "done"}
    assert classify.outcome("rejected:cancelled") == {
        "outcome": "cancelled",
        "why": "the report was refused (cancelled)",
    }
    assert classify.outcome("rejected:stale")["outcome"] == "lost"
    assert len(classify.error_line("exit code 1\n" + "x" * 5000)) == classify.ERROR_LINE_CHARS


def test_the_next_step_names_the_bigger_worker_or_why_the_task_is_not_retried():
    bigger = Outcome(True, "queued", kind="memory", bigger=("big-1", 64.0))
    assert classify.next_step(bigger, "memory", ("task_memory_gb", 8.0)) == (
        "retrying on worker big-1, which has more memory (task_memory_gb 64)"
    )
    assert classify.next_step(Outcome(True, "queued"), "memory", None) == (
        "retrying: no live worker has more memory than this one"
    )
    kept = classify.next_step(Outcome(True, "failed", not_retried=True), "timeout", None)
    assert "submit --retry-on timeout" in kept
    assert classify.next_step(Outcome(True, "queued"), "script", None) == ""


def test_a_lone_script_missing_its_neighbour_module_is_told_to_ship_the_folder():
    tail = ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'helpers.io'"]
    said = classify.module_hint(tail, frozenset({"helpers"}), "train.py")
    assert said.startswith("ModuleNotFoundError: No module named 'helpers.io': it is beside train.py")
    assert said.endswith("submit with --project DIR to ship the folder")
    assert classify.module_hint(tail, frozenset({"other"}), "train.py") == ""
    assert classify.module_hint(tail, frozenset(), "train.py") == ""
