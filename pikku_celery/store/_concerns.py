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
(``pikku_celery.engine.claims``).

Why a default ``wtimeout`` of 10 s (``DEFAULT_WTIMEOUT_MS``): a majority write waits for a
majority of the set's data-bearing members to copy it. A set that has a primary but cannot
reach that majority (a primary-secondary-arbiter set with its secondary down, two of three
secondaries lagging far behind) keeps accepting writes that never get their majority, and
without a ``wtimeout`` each one blocks its caller until the set heals: a worker's settle,
its heartbeat, a reaper's sweep, a web request's ``start``. Healthy replication takes
milliseconds and a restarted secondary catches up in seconds; 10 s rides that out and is
well under the default leases (a step's 60 s, a run's 30 s), so a settle that met one
timeout can still retry inside its lease. A write that timed out waiting for its majority
(``WTimeoutError``) *was applied on the primary* and may yet become majority-committed
(the set heals) or be rolled back (the primary fails first): its outcome is unknown, and
the store never reports it as done. The callers treat it so: a settle retries its fenced
write until its lease's deadline (a retry also waits for the majority, since the server
makes even a write that matches nothing wait for the client's last write; once the set
heals, the retry is refused by the fence and the worker finds its own outcome recorded,
once); when the deadline passes first, the settle raises, the worker gives the attempt up,
and the step is left as the set decides: settled (the stalled-run sweep wakes its run) or
still running under a lease that lapses (the reaper claims the next attempt). A claim or a
run transition that timed out is not acted on (no body runs on it); its guard keeps a second
claimer or transition from landing twice. ``wtimeout`` is per option: the URL's
``wtimeoutMS`` or a ``wtimeout`` in ``write_concern`` wins, ``0`` waits forever (MongoDB's
meaning), and ``w=1`` (which waits for no replication) gets none.

Why a deadline around the heartbeat's renewal and the settle (``deadline``, pymongo's
client-side operation timeout): ``wtimeout`` bounds the wait for replication, not a call to
a primary that stopped answering (SIGSTOPped, a VM paused, a network partition that drops
packets): pymongo then waits on the socket until its monitor gives the server up (about 20
s with the default ``connectTimeoutMS``) and the retryable write is sent again. Inside a
``deadline`` every call (server selection, the command, its wait for the majority: the
driver sends ``maxTimeMS`` in place of ``wtimeout``) ends by then, with a timeout error
whose outcome is unknown as above. The heartbeat gives each renewal a third of the lease
(its interval; at least 1 s), so a stuck renewal never holds the next one back past the
lease; a settle gives each write what is left of the lease it holds (at least 1 s); a
claim gets the step lease, an orchestration pass's calls the run lease, a reaper's sweep
its interval (``pikku_celery.engine.claims``, ``passes``, ``tasks``).

Why majority reads, and a causally consistent session per thread: a read at ``majority``
returns only writes a majority has, which no failover rolls back, so no pass acts on a write
that vanishes (a ``local`` read on the primary would: it sees a write still waiting for its
majority, as after a ``WTimeoutError``). Such a read may be *stale* right after a failover:
a new primary serves majority reads from its commit point, which can be behind a write the
old primary acknowledged until the new term's first write commits. Most decisions survive
that (every decision is a guarded write that repeats what it read, so a stale read loses its
guard, and a pass that saw too little is woken again by a settle's wake or the stalled-run
sweep), but the Dekker pairs of a run's end do not (``store._ended``): a claim that writes
its step and then reads its run stale lets a body run on an ended run, and an end that
writes the run and then reads its steps stale misses a claim made before it. So each
thread's store calls run in one causally consistent chain (``MongoWorkflowStore._causally``):
every read carries ``afterClusterTime`` of the thread's last operation and the new primary
waits until its majority snapshot covers it. It costs no command (the session only adds
fields to the commands sent anyway) and no wait on a healthy set (the primary's snapshot
already covers its own acknowledged writes). The wakes that cross processes (a worker
settles, another passes) are not ordered by it; there only the guards help, as above.
Reads go to the primary: pymongo's default read preference, which the store leaves
alone (a URL's ``readPreference=secondary`` makes passes read further behind, still safe by
the same guards, only slower to converge).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pymongo
from pymongo.errors import ConfigurationError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

DEFAULT_WRITE_CONCERN = "majority"
DEFAULT_READ_CONCERN = "majority"
DEFAULT_WTIMEOUT_MS = 10_000
MIN_DEADLINE_S = 1.0
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


def resolve_write_concern(url_concern: WriteConcern, given: WriteConcernLike | None
                          ) -> WriteConcern:
    """The store's write concern, option by option: ``given`` (the argument or setting),
    else the URL's or client options' (``url_concern``: ``w=``, ``wtimeoutMS=``,
    ``journal=``), else the default: ``w="majority"``, and ``wtimeout``
    ``DEFAULT_WTIMEOUT_MS`` unless ``w`` is 1 (no replication to wait for)."""
    options = dict(url_concern.document)
    if given is not None:
        options.update(write_concern(given).document)
    options.setdefault("w", DEFAULT_WRITE_CONCERN)
    if options["w"] != 1:
        options.setdefault("wtimeout", DEFAULT_WTIMEOUT_MS)
    return write_concern(options)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every MongoDB call made inside ends within ``seconds`` (at least
    ``MIN_DEADLINE_S``), raising a pymongo timeout error (``PyMongoError.timeout`` is
    true) whose outcome is unknown: see the module's docstring. Nested, the nearer deadline
    wins. Stores that are not MongoDB ignore it."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"deadline: {seconds!r} is not a number of seconds")
    with pymongo.timeout(max(MIN_DEADLINE_S, seconds)):
        yield


def restart_deadline(seconds: float) -> None:
    """Start the deadline of the enclosing ``deadline`` block again, ``seconds`` from now,
    for the rest of the block (its end restores what was before it, as usual).

    For a pass that ran a step in place (``passes._InPlace``): the step ran outside the
    pass's deadline, for as long as it took, and the pass's next calls get the whole
    deadline again. pymongo offers no public way to do this; its deadline lives in the
    context variables of ``pymongo._csot`` (pymongo 4.2 and later), set here as
    ``pymongo.timeout`` sets them on entry."""
    from pymongo import _csot

    seconds = max(MIN_DEADLINE_S, seconds)
    _csot.TIMEOUT.set(seconds)
    _csot.DEADLINE.set(time.monotonic() + seconds)


def default_read_concern(writes: WriteConcern) -> str:
    """``majority`` reads go with ``majority`` writes only. With ``w=1`` a write is
    acknowledged before the majority commit point covers it, so a majority read in another
    process can miss a run just started (its first pass found no run and dropped the
    message, leaving the run to the stalled-run sweep): such a store reads ``local``."""
    w = writes.document.get("w", "majority")
    return DEFAULT_READ_CONCERN if w == "majority" else "local"


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
