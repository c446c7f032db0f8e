"""Count the commands a piece of code sends to Redis and MongoDB (round trips, not time)."""

from __future__ import annotations

from collections import Counter
from typing import Any

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


class MongoCommands(monitoring.CommandListener):
    """A pymongo command listener counting commands by name (``handshake`` and
    server-monitoring chatter excluded)."""

    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in ("hello", "ismaster", "isMaster", "ping", "endSessions"):
            self.commands[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def counting_mongo(url: str) -> tuple[pymongo.MongoClient[dict[str, Any]], MongoCommands]:
    listener = MongoCommands()
    return pymongo.MongoClient(url, event_listeners=[listener]), listener
