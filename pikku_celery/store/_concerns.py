"""The write and read concerns of the MongoDB store, and the values users may give them.

Why ``w="majority"`` by default: every decision the store makes is a write whose
acknowledgement the engine acts on (a claim lets a body run, a settle lets the run move on,
a run transition ends it). On a replica set, a write acknowledged by the primary alone can
be rolled back when that primary fails before a secondary copied it: a settled step would
come back ``running`` and run again, a claim would vanish under a running body. A majority
write survives any failover that elects a new primary, so what the engine acted on stays.

Why ``readConcern "majority"`` by default: the reads a pass plans from (a run's steps, the
reaper's sweeps) then see only majority-committed writes, never a write the old primary
took but a failover will roll back. A pass reads on the primary (pymongo's default read
preference) after its own majority writes, so it still reads them.

Retryable writes (pymongo's default, ``retryWrites=true``): a write whose reply is lost in a
failover is sent once more, to the new primary, with the same transaction number, and the
server answers with the first write's outcome instead of applying it twice, so a claim that
landed is not mistaken for a lost race. When the retry fails too, the caller sees an error:
a claim then counts as not made (its store lease lapses and the reaper dispatches the step
again: no body ran), and a settle is retried by the worker until its lease's deadline, a
retry finding the step already holding exactly what it wrote recognising its own write
(``pikku_celery.claims``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo.errors import ConfigurationError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

DEFAULT_WRITE_CONCERN = "majority"
DEFAULT_READ_CONCERN = "majority"
READ_CONCERN_LEVELS = ("local", "majority", "linearizable")
_WRITE_CONCERN_KEYS = {"w", "wtimeout", "j", "fsync"}

WriteConcernLike = WriteConcern | Mapping[str, Any] | str | int
ReadConcernLike = ReadConcern | str


def write_concern(value: WriteConcernLike) -> WriteConcern:
    """A ``WriteConcern`` from one, from a mapping of its options (``{"w": "majority",
    "wtimeout": 5000, "j": True}``), or from ``w`` alone (``"majority"``, ``2``, a tag set
    name; a string of digits is a number, as an environment-fed setting gives it).

    Refuses an unacknowledged concern (``w=0``): the store decides from each write's result
    (did the guard match?), which an unacknowledged write does not return."""
    if isinstance(value, WriteConcern):
        concern = value
    elif isinstance(value, Mapping):
        unknown = set(value) - _WRITE_CONCERN_KEYS
        if unknown:
            raise ValueError(f"invalid write_concern: unknown option(s) {sorted(unknown)} "
                             f"(known: {sorted(_WRITE_CONCERN_KEYS)})")
        options = dict(value)
        if isinstance(options.get("w"), str) and options["w"].isdigit():
            options["w"] = int(options["w"])
        concern = _make(options)
    elif isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"invalid write_concern: {value!r} (a WriteConcern, a mapping of "
                         "its options, or w: 'majority' or a number)")
    else:
        concern = _make({"w": int(value) if isinstance(value, str) and value.isdigit()
                         else value})
    if not concern.acknowledged:
        raise ValueError(f"invalid write_concern: {value!r} is unacknowledged (w=0); the "
                         "store needs every write's result")
    return concern


def read_concern(value: ReadConcernLike) -> ReadConcern:
    """A ``ReadConcern`` from one or from its level (``local``, ``majority`` or
    ``linearizable``)."""
    if isinstance(value, ReadConcern):
        return value
    if not isinstance(value, str) or value not in READ_CONCERN_LEVELS:
        raise ValueError(f"invalid read_concern: {value!r} (one of "
                         f"{', '.join(READ_CONCERN_LEVELS)}, or a ReadConcern)")
    return ReadConcern(value)


def _make(options: dict[str, Any]) -> WriteConcern:
    try:
        return WriteConcern(**options)
    except (TypeError, ValueError, ConfigurationError) as exc:
        raise ValueError(f"invalid write_concern: {options!r} ({exc})") from exc
