"""Count the commands a piece of code sends to Redis and MongoDB (round trips, not time)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import bson
import pymongo
import redis
from pymongo import monitoring


class CountingRedis(redis.Redis):
    """A Redis client that counts every command it sends, by name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: Counter[str] = Counter()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands[str(args[0]).upper()] += 1
        return super().execute_command(*args, **options)


_CHATTER = ("hello", "ismaster", "isMaster", "ping", "endSessions")


class MongoCommands(monitoring.CommandListener):
    """A pymongo command listener counting commands by name (``handshake`` and
    server-monitoring chatter excluded), the documents their replies return (a find's or an
    aggregate's batches, a find-and-modify's document) and the bytes of those replies."""

    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()
        self.documents: Counter[str] = Counter()
        self.reply_bytes: Counter[str] = Counter()

    def clear(self) -> None:
        self.commands.clear()
        self.documents.clear()
        self.reply_bytes.clear()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in _CHATTER:
            self.commands[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name in _CHATTER:
            return
        reply = event.reply
        cursor = reply.get("cursor") or {}
        batch = cursor.get("firstBatch", cursor.get("nextBatch", []))
        found = len(batch) + (1 if reply.get("value") is not None else 0)
        self.documents[event.command_name] += found
        self.reply_bytes[event.command_name] += len(bson.encode(reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def counting_mongo(url: str) -> tuple[pymongo.MongoClient[dict[str, Any]], MongoCommands]:
    listener = MongoCommands()
    return pymongo.MongoClient(url, event_listeners=[listener]), listener
