"""The docs pages' examples, run as written by the test kit (as a user's pytest run would:
each example module beside its test module): events, concurrency limits, schedules (issue
26), and a Flask app factory tested with Flask's test client (issue 36)."""

from __future__ import annotations

import pytest

from tests.support.readme import readme_example

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(("module", "test"), [
    ("checkout", "test_checkout"), ("payouts", "test_payouts"), ("reports", "test_reports"),
    ("flaskshop", "test_flaskshop"),
])
def test_a_docs_example_passes_as_written(pytester: pytest.Pytester, module: str,
                                          test: str) -> None:
    pytester.makepyfile(**{module: readme_example(f"{module}.py"),
                           test: readme_example(f"{test}.py")})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
