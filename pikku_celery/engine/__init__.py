"""The runtime, with no Celery import: claims, passes, runs, gates, events, the Engine."""
