"""A Flask app with a factory, Celery set up as Flask's Celery guide does, and pikku added
as the README's Flask section shows. Everything that differs between test runs comes from
``FLASKPROJ_*`` variables."""

import os
from typing import Any

from celery import Celery, Task
from flask import Flask

from flaskproj import auth, workflows
from pikku_celery.contrib.flask import PikkuFlask

pikku = PikkuFlask()

__all__ = ("create_app", "pikku", "workflows")


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    prefix = os.environ.get("FLASKPROJ_KEY_PREFIX", "flaskproj")
    queue = os.environ.get("FLASKPROJ_QUEUE", "flaskproj")
    app.config.from_mapping(
        SECRET_KEY="flaskproj-tests-only",
        CELERY={
            "broker_url": os.environ.get("FLASKPROJ_BROKER_URL", "redis://127.0.0.1:6379/0"),
            "broker_transport_options": {"global_keyprefix": f"{prefix}:kombu:"},
            "task_default_queue": queue,
            "worker_enable_remote_control": False,
        },
        PIKKU_MONGO_URL=os.environ.get("FLASKPROJ_MONGO_URL", ""),
        PIKKU_REDIS_URL=os.environ.get("FLASKPROJ_REDIS_URL", "redis://127.0.0.1:6379/0"),
        PIKKU_KEY_PREFIX=prefix,
        PIKKU_QUEUE=queue,
        PIKKU_STEP_LEASE="5s",
        PIKKU_AUTHORIZE="flaskproj.auth:authorize",
    )
    if test_config:
        app.config.update(test_config)
    celery_init_app(app)
    pikku.init_app(app)
    app.register_blueprint(auth.bp)
    return app


def celery_init_app(app: Flask) -> Celery:
    """From Flask's Celery guide."""

    class FlaskTask(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with app.app_context():
                return self.run(*args, **kwargs)

    celery_app = Celery(app.name, task_cls=FlaskTask)
    celery_app.config_from_object(app.config["CELERY"])
    celery_app.set_default()
    app.extensions["celery"] = celery_app
    return celery_app
