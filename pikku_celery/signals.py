"""``pikku_celery.signals``, the public path of pikku's Celery signals: they live in
``pikku_celery.worker.signals``, beside the tasks that send them."""

from pikku_celery.worker.signals import *  # noqa: F403
from pikku_celery.worker.signals import __all__  # noqa: F401
