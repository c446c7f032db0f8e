"""Declared without the app: ``shared_step``/``shared_workflow`` bind to the PikkuCelery
that ``create_app`` makes (in the web process and in the worker)."""

from typing import Any

from pikku_celery import shared_step, shared_workflow


@shared_step(name="flaskproj.greet")
def greet(data: dict[str, Any]) -> str:
    return f"hello {data['name']}"


@shared_step(name="flaskproj.shout")
def shout(text: str) -> str:
    return text.upper() + "!"


@shared_workflow("greeting")
def greeting(wf: Any, data: dict[str, Any]) -> str:
    return wf.do("shout", shout, wf.do("greet", greet, data))
