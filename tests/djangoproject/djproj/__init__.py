"""A Django project as Celery's Django guide sets one up, with pikku added (README's Django
section). Everything that differs between test runs comes from ``DJPROJ_*`` variables."""

from djproj.celery import app as celery_app

__all__ = ("celery_app",)
