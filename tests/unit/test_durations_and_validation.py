"""Durations users write, and the input checks that run before any write."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pikku_celery.model.durations import to_ms, to_seconds
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.validate import MAX_VALUE_BYTES, check_name, check_value


@pytest.mark.parametrize(("value", "seconds"), [
    (5, 5.0), (0.25, 0.25), ("500ms", 0.5), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    ("2d", 172800.0), (" 1.5s ", 1.5), (timedelta(minutes=2), 120.0), (0, 0.0)])
def test_durations_in_every_accepted_form(value: object, seconds: float) -> None:
    assert to_seconds(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["soon", "5 minutes", "-1s", "1w", "", -1, float("nan"),
                                   float("inf"), True, None, [5], timedelta(seconds=-1)])
def test_invalid_durations_name_the_bad_value(value: object) -> None:
    with pytest.raises(ValueError, match="invalid lease") as info:
        to_seconds(value, what="lease")  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_milliseconds_round_up() -> None:
    assert to_ms("500ms") == 500 and to_ms(0.0001) == 1 and to_ms(2) == 2000


@pytest.mark.parametrize("name", ["charge", "charge#2", "charge:on_error", "a.b", "x" * 200])
def test_good_names(name: str) -> None:
    assert check_name("step name", name) == name


@pytest.mark.parametrize("value", [{"a": [1, 2.5, None, True, "x"]}, [], "", 2**63 - 1,
                                   {"nested": {"ok": {"deep": []}}}, (1, 2)])
def test_plain_json_values_are_accepted(value: object) -> None:
    assert check_value("data", value) > 0


def test_values_over_the_size_limit_are_refused_with_the_size() -> None:
    with pytest.raises(InvalidInputError, match=str(MAX_VALUE_BYTES)):
        check_value("result", "x" * (MAX_VALUE_BYTES + 1))


@pytest.mark.parametrize(("value", "fragment"), [
    ({"a": {"$gt": 1}}, "key '$gt' at data.a"),
    ({"a.b": 1}, "key 'a.b'"),
    ([{"ok": 1}, {"x": {1}}], "data[1].x of type set"),
    ({"f": float("nan")}, "nan"),
])
def test_refusals_point_at_the_bad_part(value: object, fragment: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        check_value("data", value)
    assert fragment in str(info.value)
