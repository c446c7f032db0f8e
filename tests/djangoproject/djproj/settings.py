import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "djproj-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "pikku_celery.contrib.django",
    "orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "djproj.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJPROJ_DB", ":memory:"),
    }
}

# Celery, read by djproj/celery.py with namespace="CELERY"; pikku's settings too.
_PREFIX = os.environ.get("DJPROJ_KEY_PREFIX", "djproj")
CELERY_BROKER_URL = os.environ.get("DJPROJ_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{_PREFIX}:kombu:"}
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DJPROJ_QUEUE", "djproj")
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_PIKKU_MONGO_URL = os.environ.get("DJPROJ_MONGO_URL", "")
CELERY_PIKKU_REDIS_URL = os.environ.get("DJPROJ_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_PIKKU_KEY_PREFIX = _PREFIX
CELERY_PIKKU_QUEUE = CELERY_TASK_DEFAULT_QUEUE
CELERY_PIKKU_STEP_LEASE = "5s"

# pikku's web API: staff users only (the default); name the Celery app explicitly.
PIKKU_CELERY_APP = "djproj.celery.app"
