"""Schedules without a beat process: ``pikku.schedule(name, workflow, cron=... | every=...)``.

The parts (this package's ``__init__`` imports none of them)::

    firing    ``Scheduler``: fires due ticks, pauses, resumes, triggers, lists
    ticker    ``ScheduleTicker``: the thread in every worker's main process that fires them

How a tick starts exactly one run. A tick is an instant the definition gives (a cron
expression read in ``tz``, or a multiple of ``every`` since the Unix epoch), the same on
every worker and across restarts. Firing it creates the run whose id is derived from the
schedule's name and the tick (``keys.scheduled_run_id``): ``create_run`` is idempotent by
id, so any number of workers firing the tick at once create one run, and a worker that
fires it again after a crash creates nothing new. *Then* the schedule's ``next_ms`` is moved
past the tick with a write guarded on the ``next_ms`` read (``store._schedules``): the other
firers' writes do nothing. A crash between the two writes leaves ``next_ms`` on the tick,
and the next round fires the same tick again, starting nothing. No lease is needed, because
firing twice does no harm; nor a beat process, because every worker runs a ticker.

The stored document is the schedule's truth for timing, workflow and data; a worker's
declaration is written to it when the worker starts (the last worker started wins, which
in a rolling deploy is the new code), keeping ``paused`` and, unless the timing changed,
the next tick. A worker fires only the schedules it declares: a schedule removed from the
code stops when no running worker declares it any more.

A schedule's declared shape and its ticks (``ScheduleDefinition``, ``Timing``) live in
``pikku_celery.workflow.schedule_spec``: the workflow layer checks a declaration, this
package fires it.
"""
