"""Celery: tasks, result backend, routing, signals, settings, inline driving, retention."""
