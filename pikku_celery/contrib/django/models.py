"""The start intents of ``start_on_commit`` (``intents``): one row per start asked for in a
transaction, written in that transaction and deleted once the run was started."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class StartIntent(models.Model):
    """A run to start: written with the caller's rows, so it commits or rolls back with
    them. Deleted once ``pikku.start(workflow, data, run_id=run_id)`` succeeded, at the
    commit or later by a worker's reaper (``drain_start_intents``). ``refused``: the run id
    already names another workflow or input (``WorkflowRunConflictError``); the row is kept
    for an operator to read and never started again."""

    run_id = models.CharField(max_length=200, db_index=True)
    workflow = models.CharField(max_length=200)
    data = models.TextField(help_text="the run's input as JSON text")
    created = models.DateTimeField(default=timezone.now, db_index=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    refused = models.BooleanField(default=False)

    class Meta:
        db_table = "pikku_start_intent"
        ordering = ["created", "id"]
        verbose_name = "start intent"

    def __str__(self) -> str:
        return f"{self.workflow} {self.run_id}"
