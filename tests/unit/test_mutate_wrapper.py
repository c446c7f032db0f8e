"""``./dev mutate`` must fail when mutmut could not test: a check that cannot fail is a
defect (issue 21: mutmut's clean run failed on a file missing from its copy, and the
wrapper printed "0 survived")."""

from __future__ import annotations

from tests import mutate


def test_a_mutmut_failure_is_a_failure_whatever_it_recorded() -> None:
    assert mutate._failure(1, {}) == "mutmut exited with 1"
    assert mutate._failure(2, {"m__x_1": "survived"}) == "mutmut exited with 2"


def test_a_run_that_checked_no_mutant_is_a_failure() -> None:
    assert mutate._failure(0, {}) == "mutmut reported no mutant"
    untested = {"m__x_1": "not checked", "m__x_2": "no tests"}
    assert mutate._failure(0, untested) == "none of 2 mutants was tested"


def test_a_run_that_stopped_part_way_is_a_failure() -> None:
    statuses = {"m__x_1": "killed", "m__x_2": "not checked", "m__x_3": "survived"}
    assert mutate._failure(0, statuses) == "1 of 3 mutants were never checked"


def test_a_complete_run_with_survivors_is_not_a_failure_of_the_command() -> None:
    statuses = {"m__x_1": "killed", "m__x_2": "survived", "m__x_3": "timeout"}
    assert mutate._failure(0, statuses) is None


def test_mutmuts_copy_has_the_files_the_tests_read() -> None:
    # tests/support/readme.py reads README.md and docs/: mutmut's copy must carry both.
    assert 'also_copy = ["README.md", "docs"]' in mutate.CONFIG
