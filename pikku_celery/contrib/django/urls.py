"""``path("pikku/", include("pikku_celery.contrib.django.urls"))``: the JSON API under
``pikku/api/`` (see ``_api.ROUTES``); URL names are ``pikku:<route>`` (``pikku:run``...)."""

from __future__ import annotations

from django.urls import path

from pikku_celery.contrib._api import ROUTES
from pikku_celery.contrib.django.views import VIEWS

app_name = "pikku"

urlpatterns = [path(route.path, VIEWS[route.name], name=route.name) for route in ROUTES]
