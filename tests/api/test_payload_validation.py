"""Payload validation: one clear message per mistake."""

from __future__ import annotations

import pytest

from gpumesh.errors import UsageError
from gpumesh.models import parse_payloads

pytestmark = pytest.mark.core


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON (line 1"),
        ('{"a": 1}', "must be a JSON list of objects, got a JSON dict"),
        ("[]", "empty list"),
        ("[1, 2]", "payloads[0] must be a JSON object"),
        ('[{"cost": 0}]', "payloads[0].cost must be a positive number, got 0"),
        ('[{"a": 1}, {"cost": "heavy"}]', 'payloads[1].cost must be a positive number, got "heavy"'),
        ('[{"cost": true}]', "payloads[0].cost must be a positive number, got true"),
        ('[{"cost": -2.5}]', "got -2.5"),
    ],
)
def test_bad_payloads_name_the_problem(text: str, message: str):
    with pytest.raises(UsageError) as exc:
        parse_payloads(text)
    assert message in str(exc.value)
    assert exc.value.exit_code == 2


def test_good_payloads_pass_through_with_cost_kept():
    assert parse_payloads('[{"lr": 0.1, "cost": 2.5}, {"lr": 1}]') == [{"lr": 0.1, "cost": 2.5}, {"lr": 1}]
