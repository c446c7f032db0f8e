"""Django: ``path("workflows/", include(pikku_urls(pikku)))`` in your URLconf.

A JSON API to start runs and read and cancel them (see ``_api``). The ``PikkuCelery`` is the
one bound to your project's Celery app (``celery_app.pikku``), built in the module where the
Celery app is, as the Celery-with-Django guide sets it up.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import URLPattern, path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._api import Response, RunsApi, handle, parse_body


def pikku_urls(pikku: PikkuCelery) -> list[URLPattern]:
    api = RunsApi(pikku)

    def reply(response: Response) -> JsonResponse:
        status, payload = response
        return JsonResponse(payload, status=status)

    def body(request: HttpRequest) -> Any:  # parsed inside ``handle``: too deep is a 400
        return parse_body(request.body)

    @require_GET
    def list_runs(request: HttpRequest) -> JsonResponse:
        return reply(api.list_runs(request.GET))

    @require_GET
    def get_run(request: HttpRequest, run_id: str) -> JsonResponse:
        return reply(api.get_run(run_id))

    @require_GET
    def get_steps(request: HttpRequest, run_id: str) -> JsonResponse:
        return reply(api.get_steps(run_id))

    @require_GET
    def get_history(request: HttpRequest, run_id: str) -> JsonResponse:
        return reply(api.get_history(run_id))

    @csrf_exempt
    @require_POST
    def cancel(request: HttpRequest, run_id: str) -> JsonResponse:
        return reply(handle(lambda: api.cancel(run_id, body(request))))

    @csrf_exempt
    @require_POST
    def start(request: HttpRequest, workflow: str) -> JsonResponse:
        return reply(handle(lambda: api.start(workflow, body(request))))

    return [
        path("runs", list_runs, name="pikku-runs"),
        path("runs/<str:run_id>", get_run, name="pikku-run"),
        path("runs/<str:run_id>/steps", get_steps, name="pikku-steps"),
        path("runs/<str:run_id>/history", get_history, name="pikku-history"),
        path("runs/<str:run_id>/cancel", cancel, name="pikku-cancel"),
        path("<str:workflow>/runs", start, name="pikku-start"),
    ]
