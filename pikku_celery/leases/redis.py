"""Redis leases: every decision is one Lua script judged on the Redis server's clock.

Keys (see ``pikku_celery.model.keys``; ``<prefix>`` is the service's ``key_prefix``):

* ``<prefix>:lease:{<key>}``        hash ``{holder, token}`` with a ``PEXPIRE`` of the TTL.
  The key exists exactly while the lease is live: Redis expiry *is* the lease deadline.
* ``<prefix>:lease-token:{<key>}``  integer counter, ``INCR``-ed for every fresh grant, so
  tokens keep rising across lapses and releases. It is never deleted, and expires only
  after ``counter_ttl_ms(ttl)`` = max(30 days, 1000 x the lease TTL) with no grant and no
  renewal of its key (every ACQUIRE and every renewal pushes it back), so a key that is used
  once does not stay in Redis forever.
* ``<prefix>:lease-marks:{<key>}``  set of the marks left on the key and not yet taken
  (``acquire_or_mark``, ``mark``); taken by the next grant or by the holder handing the
  lease back. Expires a day after the last mark (a mark nobody takes in a day is stale).
* ``<prefix>:lease-done:{<key>}``   not a key: the pub/sub channel of the key's
  announcements (``announce``, ``listen``; ``leases.announcements``).
* ``<prefix>:lease-watch:{<key>}``  present while a watch is armed for the current holder
  (``LeaseBusy.watch``); expires just after that holder's lease would lapse, and a grant
  deletes it.

What the counter TTL means for "tokens never go backwards": it holds for as long as the key
is in use, and for 30 days (at least 1000 lease TTLs) after its last grant or renewal. Only
a key idle that long starts again at token 1, when no lease on it can be live: a lease hash
lives one TTL past its last grant or renewal, a thousandth of the counter's. The one thing
that could then meet a repeated token is a ``Lease`` handle kept from before the idle month;
refresh and release compare the holder too, and pikku draws a fresh random holder for every
grant, so even that handle cannot act on the new grant. (Step writes are fenced by the
store's attempt number, not by this token.) Counters written before the TTL existed get it
at their next use.

Redis Cluster: the ``{<key>}`` hash tag puts the four keys of one lease (hash, counter,
marks, watch) in one cluster slot, so every script that touches several of them runs on one
node; a key prefix may not contain braces, which would move the tag. Every script but
REFRESH_MANY is about one lease. ``refresh_many`` groups its leases by slot and makes one
script call per slot (on a single server, one call for all). Each lease is judged by the
clock of the node that owns its slot: keep the nodes' clocks in sync (NTP), as a failover
hands a slot to another node's clock. Connect with ``from_url("redis+cluster://h:p,h:p")``
or pass a ``redis.cluster.RedisCluster``.

Atomicity: ACQUIRE, REFRESH_MANY, RELEASE, GET, ACQUIRE_OR_MARK, MARK and
RELEASE_OR_TAKE_MARKS are each one script (``lua/<name>.lua`` beside this module, each
with its keys, arguments and reply documented), so each is atomic and one round trip. No
method reads the local clock: the scripts take ``TIME`` from the server and expiry is
Redis's own TTL, so a worker whose clock is skewed by an hour can neither steal a live
lease nor extend one past its TTL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from pikku_celery.leases._lua import lua_script
from pikku_celery.leases.announcements import redis_listener
from pikku_celery.leases.base import Lease, LeaseBusy, Listener, PartialRefreshError
from pikku_celery.leases.memory import (
    WATCH_SLACK_MS,
    check_holder,
    check_key,
    check_mark,
    check_ttl_ms,
)
from pikku_celery.leases.outage import name_outages
from pikku_celery.model._fork import reset_in_forked_child
from pikku_celery.model._urls import redact_url, reserved_in_userinfo
from pikku_celery.model.keys import (
    LEASE_DONE_FMT,
    LEASE_HASH_FMT,
    LEASE_MARKS_FMT,
    LEASE_NOTE_FMT,
    LEASE_NOTE_TTL_MS,
    LEASE_TOKEN_FMT,
    LEASE_WATCH_FMT,
)

COUNTER_TTL_FLOOR_MS = 30 * 24 * 3600 * 1000
COUNTER_TTL_LEASES = 1000


def counter_ttl_ms(ttl_ms: int) -> int:
    """How long a token counter outlives the last grant or renewal of its key."""
    return max(COUNTER_TTL_FLOOR_MS, COUNTER_TTL_LEASES * ttl_ms)


ACQUIRE = lua_script("acquire")
REFRESH_MANY = lua_script("refresh_many")
ACQUIRE_OR_MARK = lua_script("acquire_or_mark")
MARK = lua_script("mark")
RELEASE_OR_TAKE_MARKS = lua_script("release_or_take_marks")
RELEASE = lua_script("release")
GET = lua_script("get")

# Why the holder *and* token compare happens inside Lua, never as GET-then-act in Python:
#
#   t0  worker A holds the lease (token 7) and stalls (GC pause, slow network)
#   t1  the lease expires; worker B acquires it: token 8
#   t2  A wakes, reads the hash in Python, is about to compare
#   t3  B releases; A, B or C re-acquires with token 9 ...
#   t4  A's unconditional PEXPIRE / DEL now extends or deletes someone else's lease
#
# A holder check alone is not enough either: if A re-acquires after its own lapse it gets a
# new token, and a stale handle from the old grant must not act for the new one.


class RedisLeaseService:
    """Fenced leases in Redis; every operation is one Lua script and one round trip."""

    def __init__(self, client: redis.Redis | RedisCluster, *,
                 key_prefix: str | None = None) -> None:
        if key_prefix is not None:
            _check_prefix(key_prefix)
        self._client: Any = client
        # On a cluster a script's keys must share a slot: refresh_many splits by slot.
        self._cluster = isinstance(client, RedisCluster | _LazyCluster)
        # Unset, the prefix becomes the bound Celery app's main name (``adopt_prefix``):
        # two apps sharing one Redis must not share a reaper lease, nor run leases for run
        # ids both happen to choose. ``pikku`` until then.
        self._key_prefix = key_prefix if key_prefix is not None else DEFAULT_KEY_PREFIX
        self._prefix_chosen = key_prefix is not None
        self._acquire = client.register_script(ACQUIRE)
        self._refresh_many = client.register_script(REFRESH_MANY)
        self._release = client.register_script(RELEASE)
        self._get = client.register_script(GET)
        self._acquire_or_mark = client.register_script(ACQUIRE_OR_MARK)
        self._mark = client.register_script(MARK)
        self._release_or_take_marks = client.register_script(RELEASE_OR_TAKE_MARKS)

    @classmethod
    def from_url(cls, url: str, key_prefix: str | None = None) -> RedisLeaseService:
        """A service on a new client for ``url``; nothing connects until the first call.
        Without ``key_prefix``, the prefix is the main name of the Celery app it is bound
        to (``PikkuCelery``), else ``pikku``.

        ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``
        for TLS) names a Redis Cluster by some of its nodes; the client finds the rest.
        Any other URL is a single server, as ``redis.Redis.from_url`` reads it."""
        if url.startswith(("redis+cluster://", "rediss+cluster://")):
            return cls(_LazyCluster.from_url(url), key_prefix=key_prefix)  # type: ignore[arg-type]
        return cls(redis.Redis.from_url(url), key_prefix=key_prefix)

    @property
    def key_prefix(self) -> str:
        """The prefix in front of every key this service writes."""
        return self._key_prefix

    def adopt_prefix(self, name: str | None) -> None:
        """Take ``name`` (a Celery app's main name) as the prefix unless one was chosen at
        construction; called by ``PikkuCelery`` when it binds, before any key is written.
        A name that cannot be a prefix (empty, with braces) leaves ``pikku``."""
        if self._prefix_chosen or not name:
            return
        try:
            _check_prefix(name)
        except ValueError:
            return
        self._key_prefix = name
        self._prefix_chosen = True

    def lease_hash_key(self, key: str) -> str:
        """The physical Redis key of the lease hash for logical ``key``."""
        return LEASE_HASH_FMT.format(prefix=self._key_prefix, key=key)

    def token_counter_key(self, key: str) -> str:
        """The physical Redis key of the token counter for logical ``key``."""
        return LEASE_TOKEN_FMT.format(prefix=self._key_prefix, key=key)

    def acquire(self, key: str, holder: str, ttl_ms: int) -> Lease | None:
        """Grant ``key`` to ``holder`` for ``ttl_ms`` ms; ``None`` if another holder is live.

        A fresh grant gets the key's next token; the live holder re-acquiring keeps its token
        and gets a new expiry. Raises ``ValueError`` for an empty key or holder or a
        non-positive ``ttl_ms``; Redis errors propagate.
        """
        check_key(key)
        check_holder(holder)
        check_ttl_ms(ttl_ms)
        keys = [self.lease_hash_key(key), self.token_counter_key(key)]
        reply = self._acquire(keys=keys, args=[holder, ttl_ms, counter_ttl_ms(ttl_ms)])
        if reply is None:
            return None
        token, now_ms = (int(part) for part in reply)
        return Lease(key, holder, token, now_ms + ttl_ms, now_ms)

    def refresh(self, lease: Lease, ttl_ms: int) -> Lease | None:
        """Extend ``lease`` to server-now + ``ttl_ms`` if it is live and still ours."""
        return self.refresh_many([(lease, ttl_ms)])[0]

    def refresh_many(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        """Refresh every ``(lease, ttl_ms)`` pair in one script call; results in order.

        ``None`` marks a lease that lapsed, was released or passed to another grant.
        """
        if not leases:
            return []
        for _, ttl_ms in leases:
            check_ttl_ms(ttl_ms)
        if not self._cluster:
            return self._refresh_group(leases)
        # A cluster runs a script only when all its keys share a slot (a lease's two keys
        # always do): one call per slot, each lease judged by its own node's clock.
        by_slot: dict[int, list[int]] = {}
        for i, (lease, _) in enumerate(leases):
            slot = key_slot(self.lease_hash_key(lease.key).encode())
            by_slot.setdefault(slot, []).append(i)
        out: list[Lease | None] = [None] * len(leases)
        unconfirmed: set[int] = set()
        failure: Exception | None = None
        for indexes in by_slot.values():
            try:
                renewed = self._refresh_group([leases[i] for i in indexes])
            except Exception as exc:  # that slot's node: the others' answers still count
                unconfirmed.update(indexes)
                failure = exc
                continue
            for i, result in zip(indexes, renewed, strict=True):
                out[i] = result
        if failure is not None:
            if len(unconfirmed) == len(leases):
                raise failure
            raise PartialRefreshError(out, unconfirmed, failure)
        return out

    def _refresh_group(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        keys: list[str] = []
        args: list[str | int] = []
        for lease, ttl_ms in leases:
            keys.extend((self.lease_hash_key(lease.key), self.token_counter_key(lease.key)))
            args.extend((lease.holder, str(lease.token), ttl_ms, counter_ttl_ms(ttl_ms)))
        now_ms, *flags = (int(part) for part in self._refresh_many(keys=keys, args=args))
        return [
            _renewed(lease, ttl_ms, now_ms) if flag else None
            for (lease, ttl_ms), flag in zip(leases, flags, strict=True)
        ]

    def release(self, lease: Lease) -> bool:
        """Delete the lease if holder and token still match; whether anything was freed."""
        keys = [self.lease_hash_key(lease.key)]
        return bool(self._release(keys=keys, args=[lease.holder, str(lease.token)]))

    def get(self, key: str) -> Lease | None:
        """The live lease on ``key`` or ``None``; ``granted_at_ms`` is the server read time."""
        check_key(key)
        reply = self._get(keys=[self.lease_hash_key(key)])
        if reply is None:
            return None
        holder, token, pttl_ms, now_ms = reply
        return Lease(key, _text(holder), int(token), int(now_ms) + int(pttl_ms), int(now_ms))

    def marks_key(self, key: str) -> str:
        """The physical Redis key of the marks left on logical ``key``."""
        return LEASE_MARKS_FMT.format(prefix=self._key_prefix, key=key)

    def note_key(self, key: str) -> str:
        """The physical Redis key of the note the last holder of ``key`` left."""
        return LEASE_NOTE_FMT.format(prefix=self._key_prefix, key=key)

    def watch_key(self, key: str) -> str:
        """The physical Redis key of the watch armed for ``key``'s holder."""
        return LEASE_WATCH_FMT.format(prefix=self._key_prefix, key=key)

    def acquire_or_mark(self, key: str, holder: str, ttl_ms: int, mark: str
                        ) -> Lease | LeaseBusy:
        """``acquire``, the grant taking the key's marks; or leave ``mark`` for the live
        holder (see ``LeaseService.acquire_or_mark``). One script call."""
        check_key(key)
        check_holder(holder)
        check_ttl_ms(ttl_ms)
        check_mark(mark)
        keys = [self.lease_hash_key(key), self.token_counter_key(key), self.marks_key(key),
                self.watch_key(key), self.note_key(key)]
        reply = self._acquire_or_mark(keys=keys, args=[
            holder, ttl_ms, counter_ttl_ms(ttl_ms), mark, MARKS_TTL_MS, WATCH_SLACK_MS])
        if int(reply[0]) == 0:
            return LeaseBusy(int(reply[1]), bool(int(reply[2])))
        token, now_ms = int(reply[1]), int(reply[2])
        marks = tuple(sorted(_text(m) for m in reply[3]))
        note = _bytes(reply[4]) if len(reply) > 4 else None
        return Lease(key, holder, token, now_ms + ttl_ms, now_ms, marks, note)

    def mark(self, key: str, mark: str) -> None:
        """Leave ``mark`` on ``key`` for its holder, or for the next grant."""
        check_key(key)
        check_mark(mark)
        self._mark(keys=[self.marks_key(key)], args=[mark, MARKS_TTL_MS])

    def release_or_take_marks(self, lease: Lease, ttl_ms: int, note: bytes | None = None,
                              *, announce: bool = False) -> tuple[str, ...] | None:
        """Take the key's marks and keep the lease, or release it when there are none
        (leaving ``note`` for the next grant); ``None`` when ``lease`` is no longer this
        grant's. ``announce``: ``announce`` the key in the same script. One script call."""
        check_ttl_ms(ttl_ms)
        keys = [self.lease_hash_key(lease.key), self.token_counter_key(lease.key),
                self.marks_key(lease.key), self.note_key(lease.key)]
        reply = self._release_or_take_marks(keys=keys, args=[
            lease.holder, str(lease.token), ttl_ms, counter_ttl_ms(ttl_ms), note or b"",
            LEASE_NOTE_TTL_MS, self.announce_channel(lease.key) if announce else ""])
        flag = int(reply[0])
        if flag < 0:
            return None
        if flag == 0:
            return ()
        return tuple(sorted(_text(m) for m in reply[1]))

    def announce_channel(self, key: str) -> str:
        """The pub/sub channel of logical ``key``'s announcements."""
        return LEASE_DONE_FMT.format(prefix=self._key_prefix, key=key)

    def announce(self, key: str) -> None:
        """``PUBLISH`` on the key's channel (``LeaseService.announce``)."""
        check_key(key)
        self._client.publish(self.announce_channel(key), b"done")

    def listen(self, key: str) -> AbstractContextManager[Listener]:
        """A ``SUBSCRIBE`` connection of its own on the key's channel, confirmed before the
        block begins (``LeaseService.listen``)."""
        check_key(key)
        return redis_listener(self._client, self.announce_channel(key))

    def describe(self) -> str:
        """``Redis at redis://<host>:<port>/<db>``, for log lines: never the password
        (``Redis Cluster at redis+cluster://<host>:<port>,...`` for a cluster)."""
        if isinstance(self._client, _LazyCluster):
            return f"Redis Cluster at {self._client.describe()}"
        if isinstance(self._client, RedisCluster):
            nodes = ",".join(f"{node.host}:{node.port}"
                             for node in self._client.nodes_manager.startup_nodes.values())
            return f"Redis Cluster at redis+cluster://{nodes}"
        kwargs = self._client.connection_pool.connection_kwargs
        if kwargs.get("path"):
            return f"Redis at unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
        return (f"Redis at redis://{kwargs.get('host', 'localhost')}:"
                f"{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}")

    def ping(self) -> None:
        """Ask the server to answer; ``ConnectionError`` naming it when it does not."""
        try:
            self._client.ping()
        except (redis.RedisError, RedisClusterException) as exc:  # no cluster node answers
            raise ConnectionError(f"{self.describe()} is unreachable: {exc}") from exc

    def now_ms(self) -> int:
        """The Redis server clock (``TIME``) in epoch ms, never the local clock."""
        seconds, micros = self._client.time()
        return int(seconds) * 1000 + int(micros) // 1000


def _renewed(lease: Lease, ttl_ms: int, now_ms: int) -> Lease:
    return Lease(lease.key, lease.holder, lease.token, now_ms + ttl_ms, now_ms)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> str:
    # The client may or may not decode responses; holders are always str to callers.
    return value.decode() if isinstance(value, bytes) else str(value)


DEFAULT_KEY_PREFIX = "pikku"
MARKS_TTL_MS = 24 * 3600 * 1000


def _check_prefix(key_prefix: object) -> None:
    # A brace in the prefix would become the cluster hash tag and split a lease's two keys
    # across slots.
    if not isinstance(key_prefix, str) or not key_prefix or "{" in key_prefix or "}" in key_prefix:
        raise ValueError(
            f"invalid key_prefix: {key_prefix!r} (must be a non-empty str without braces)"
        )


class _LazyCluster:
    """A ``RedisCluster`` made at its first use. ``RedisCluster`` connects to its nodes as
    it is constructed, and a pikku engine opens no connection until it is used (an app
    module imported by a web process, or by ``celery -A proj pikku show``, must load with
    Redis down). Attribute reads build the client (once, under a lock) and delegate."""

    def __init__(self, nodes: list[tuple[str, int]], scheme: str,
                 kwargs: dict[str, Any]) -> None:
        self._nodes = nodes
        self._scheme = scheme
        self._kwargs = kwargs
        self._built: RedisCluster | None = None
        self._lock = threading.Lock()
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # The parent's reaper thread may hold the lock (it builds the client under it) at
        # the instant the prefork pool forks; a child builds its own client, whose
        # connections and locks are not the parent's.
        self._lock = threading.Lock()
        self._built = None

    @classmethod
    def from_url(cls, url: str) -> _LazyCluster:
        """Parse ``redis+cluster://[user:password@]host[:port][,host[:port]...][/0]``."""
        parts = urlsplit(url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes = [_host_port(item, url) for item in hosts.split(",") if item]
        if not nodes:
            raise ValueError(f"invalid Redis Cluster URL {redact_url(url)!r}: no host")
        if parts.path not in ("", "/", "/0") or parts.query:
            raise ValueError(
                f"invalid Redis Cluster URL {redact_url(url)!r}: a cluster has only database 0 "
                "and this URL takes no options (pass a redis.cluster.RedisCluster for more)")
        kwargs: dict[str, Any] = {}
        if userinfo:
            user, has_password, password = userinfo.partition(":")
            if user:
                kwargs["username"] = unquote(user)
            if has_password:
                kwargs["password"] = unquote(password)
        if parts.scheme == "rediss+cluster":
            kwargs["ssl"] = True
        return cls(nodes, parts.scheme, kwargs)

    def describe(self) -> str:
        return f"{self._scheme}://" + ",".join(f"{host}:{port}" for host, port in self._nodes)

    def register_script(self, source: str) -> Script:
        # A script is its text and SHA-1 until called: registering builds nothing.
        return Script(self, source)  # type: ignore[arg-type]

    def get_encoder(self) -> _Utf8:
        # What ``Script`` asks for to hash its text, without connecting.
        return _Utf8()

    def client(self) -> RedisCluster:
        with self._lock:
            if self._built is None:
                self._built = RedisCluster(
                    startup_nodes=[ClusterNode(host, port)  # type: ignore[no-untyped-call]
                                   for host, port in self._nodes],
                    **self._kwargs)
            return self._built

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client(), name)


class _Utf8:
    def encode(self, value: str) -> bytes:
        return value.encode("utf-8")


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, colon, port = item.rpartition(":")
    if not colon or host.endswith(":") or (host.startswith("[") != host.endswith("]")):
        host, port = item, "6379"  # no port given (a bare IPv6 address needs brackets)
    host = host.strip("[]")
    if not host or not port.isdigit():
        if reserved_in_userinfo(url):  # the "node" is a piece of the password: not shown
            raise ValueError(f"invalid Redis Cluster URL {redact_url(url)!r}: its user name or "
                             "password holds '/', '?', '#' or '@': percent-encode them")
        raise ValueError(f"invalid Redis Cluster URL {redact_url(url)!r}: bad node {item!r}")
    return host, int(port)



name_outages(RedisLeaseService)  # a Redis that does not answer is named (leases/outage.py)
