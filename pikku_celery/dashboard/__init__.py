"""The dashboard: server-rendered pages over a ``PikkuCelery`` (no JavaScript build; a few
lines of vanilla JS re-read live pages).

- **Runs** (``<mount>/``): newest first, filtered by workflow, status and creation time,
  searched by run id prefix, paged (``?before=<run id>``), with a count per status (each
  an index-served count that stops at 10,000), refreshed every few seconds.
- **Run** (``<mount>/runs/<run_id>``): status, timings, input/output/error, a graph
  workflow's graph with each node's visits (inline SVG, ``graph_view.py``), the
  per-attempt timeline chart (inline SVG, ``chart.py``), every attempt, compensations,
  each step's input and result on demand (read from the JSON API's step route), child
  runs, cancel/resume/retry buttons and a fork form for callers allowed to; a scheduled
  run's schedule and tick.
- **Schedules** (``<mount>/schedules``, linked from every page's header): each schedule's
  timing, state, ticks and last run, with Pause/Resume and Trigger forms for callers
  allowed to (``_schedules.py``).

Mounted by the Django app (``pikku_celery.contrib.django.urls``) and the Flask extension
(its blueprint), behind the JSON API's ``authorize`` rules; served alone by ``pikku
dashboard`` (``standalone.py``). Pages are built by ``_pages.Dashboard`` and rendered by
Jinja2 with autoescaping; the adapters (``flask.py``, ``django.py``) authorize, check
CSRF and form sizes, and send the security headers (a CSP that runs only the page's own
script, no framing, no caching).

The standalone dashboard needs Flask and waitress, which pikku does not install by itself:
without them ``pikku dashboard`` (and importing ``standalone``) fails with the extra to
install, ``pip install 'pikku-celery[dashboard]'`` (``missing_extra``).
"""

from __future__ import annotations

EXTRA = "pikku-celery[dashboard]"


def missing_extra(exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for a missing Flask or waitress: which extra to install."""
    return ModuleNotFoundError(
        f"the pikku dashboard needs {exc.name or 'a module'!r}, which is not installed: "
        f"pip install '{EXTRA}' (Flask and waitress)", name=exc.name)
