"""The Celery node name of the worker of each app started in this process, for the worker
recorded with each step attempt (``w1@host:1234``, the name given with ``celery worker -n``
and the process that ran the attempt).

Learnt per app at ``worker_init`` (``routing.Routing``), before a prefork pool forks its
children, which inherit it; not known (no worker of the app started in this process: a
``pikku.start(..., inline=True)``, a script): the host name, as before.
"""

from __future__ import annotations

import socket
import weakref
from typing import Any

# Per app: a test process starts in-process workers of many apps, each with its own name.
_nodes: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def note_worker_node(app: Any, nodename: Any) -> None:
    """Remember the node name (``w1@host``) of ``app``'s worker starting here."""
    if isinstance(nodename, str) and nodename:
        _nodes[app] = nodename


def forget_worker_node(app: Any) -> None:
    """``app``'s worker stopped: the host name again."""
    _nodes.pop(app, None)


def worker_host(app: Any) -> str:
    """What names this process in an attempt's worker, before ``:<pid>``: the node name of
    ``app``'s worker when one started here, else the host name."""
    return _nodes.get(app) or socket.gethostname()
