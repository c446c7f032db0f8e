"""An example pikku-celery project: ``celery -A example_project worker`` runs it.

``app`` and ``pikku`` are loaded on first access, so importing a helper module of this
package (the demo, the stack) does not build the Celery app before its settings are set.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("app", "pikku"):
        from example_project import celery_app

        return getattr(celery_app, name)
    raise AttributeError(name)
