import os

from celery import Celery

from pikku_celery import PikkuCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproj.settings")

app = Celery("djproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
pikku = PikkuCelery(app)  # store and leases from CELERY_PIKKU_* settings, at first use
