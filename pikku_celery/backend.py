"""``pikku_celery.backend``, the public path of the result backend (Celery's
``result_backend = "pikku_celery.backend:PikkuResultBackend+mongodb://..."``): it lives in
``pikku_celery.worker.backend``."""

from pikku_celery.worker.backend import PikkuResultBackend

__all__ = ["PikkuResultBackend"]
