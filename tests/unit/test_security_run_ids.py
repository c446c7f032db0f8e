"""Issue 22, item 11: ``start`` refuses a run id that could never be served (a ``/``
in it, and every character outside the documented set), from Python and so from the web
API, which starts runs through the same path. Each test fails without the fix."""

from __future__ import annotations

import uuid

import pytest

from pikku_celery import InMemoryWorkflowStore, InvalidInputError
from pikku_celery.model.validate import check_run_id
from tests.support.family import make_family

# --- 11: run ids that could never be served -----------------------------------------------------


@pytest.mark.parametrize("run_id", ["team/42", "a?b", "a#b", "50%", "a\\b", "a b", "..",
                                    "caf\u00e9", "@taken"])
def test_11_start_refuses_a_run_id_that_could_not_be_served(run_id: str) -> None:
    store = InMemoryWorkflowStore()
    pikku = make_family(store)
    with pytest.raises(InvalidInputError, match=r"run id .* is not allowed"):
        pikku.start("sec.kid", None, run_id=run_id)
    assert pikku.list_runs() == []


# A fixed id for the random one: pytest-xdist needs every process to collect the same ids.
@pytest.mark.parametrize("run_id", ["order-42", "a:b", "2024-01-01T10:00:00Z",
                                    "user@example.com:7", "v1.2_x+y=z~",
                                    pytest.param(str(uuid.uuid4()), id="uuid4")])
def test_11_ordinary_run_ids_are_accepted(run_id: str) -> None:
    assert check_run_id(run_id) == run_id
    assert make_family().start("sec.kid", None, run_id=run_id) == run_id


def test_11_the_error_names_the_character() -> None:
    with pytest.raises(InvalidInputError, match="'/'"):
        check_run_id("team/42")
