"""Flask: ``init_app(flask_app, pikku, url_prefix="/workflows")``.

Makes the ``PikkuCelery`` reachable as ``current_pikku()`` inside requests, and (with a
``url_prefix``) mounts a JSON API to start runs and read and cancel them (see ``_api``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request
from flask.typing import ResponseReturnValue

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._api import Response, RunsApi, handle, parse_body

EXTENSION = "pikku"


def init_app(flask_app: Flask, pikku: PikkuCelery, *, url_prefix: str | None = None) -> None:
    flask_app.extensions[EXTENSION] = pikku
    if url_prefix is not None:
        flask_app.register_blueprint(blueprint(pikku), url_prefix=url_prefix)


def current_pikku() -> PikkuCelery:
    """The ``PikkuCelery`` of the current Flask app."""
    pikku: PikkuCelery = current_app.extensions[EXTENSION]
    return pikku


def blueprint(pikku: PikkuCelery) -> Blueprint:
    api = RunsApi(pikku)
    bp = Blueprint("pikku", __name__)

    def reply(response: Response) -> ResponseReturnValue:
        status, payload = response
        return jsonify(payload), status

    def body() -> Any:  # parsed inside ``handle``: a too-deep body is a 400
        return parse_body(request.get_data()) if request.is_json else None

    bp.add_url_rule("/runs", "list_runs", lambda: reply(api.list_runs(request.args)))
    bp.add_url_rule("/runs/<run_id>", "get_run", lambda run_id: reply(api.get_run(run_id)))
    bp.add_url_rule("/runs/<run_id>/steps", "get_steps",
                    lambda run_id: reply(api.get_steps(run_id)))
    bp.add_url_rule("/runs/<run_id>/history", "get_history",
                    lambda run_id: reply(api.get_history(run_id)))
    bp.add_url_rule("/runs/<run_id>/cancel", "cancel",
                    lambda run_id: reply(handle(lambda: api.cancel(run_id, body()))),
                    methods=["POST"])
    bp.add_url_rule("/<workflow>/runs", "start",
                    lambda workflow: reply(handle(lambda: api.start(workflow, body()))),
                    methods=["POST"])
    return bp
