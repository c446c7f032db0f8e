"""``path("pikku/", include("pikku_celery.contrib.django.urls"))``: the JSON API under
``pikku/api/`` (see ``_api.ROUTES``) and the dashboard (``pikku_celery.dashboard.django``);
URL names are ``pikku:<route>`` (``pikku:run``, ``pikku:dashboard``...)."""

from __future__ import annotations

from django.urls import path

from pikku_celery.contrib._api import ROUTES
from pikku_celery.contrib.django.views import VIEWS
from pikku_celery.dashboard.django import urlpatterns as dashboard_urls

app_name = "pikku"

urlpatterns = [path(route.path, VIEWS[route.name], name=route.name) for route in ROUTES]
urlpatterns += dashboard_urls  # the dashboard: pikku/ and pikku/runs/<run_id>
