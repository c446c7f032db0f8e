"""``celery -A flaskproj.make_celery worker``, as Flask's Celery guide runs it."""

from flaskproj import create_app

flask_app = create_app()
celery_app = flask_app.extensions["celery"]
