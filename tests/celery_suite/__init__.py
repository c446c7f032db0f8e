"""Celery's own integration suite, run from the sdist of the installed Celery version, alone
and with a ``PikkuCelery`` bound to its session app (``./dev celery-suite``)."""
