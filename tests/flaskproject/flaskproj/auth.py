"""Session login (the cookie a cross-site request would carry) and pikku's authorize."""

from typing import Any

from flask import Blueprint, abort, request, session

bp = Blueprint("auth", __name__)
ROLES = {"ada": "admin", "bob": "viewer"}


@bp.post("/login")
def login() -> tuple[str, int]:
    name = request.form["name"]
    if name not in ROLES:
        abort(403)
    session["user"] = name
    return "", 204


def authorize(request: Any, action: str, run_id: str | None) -> bool:
    """PIKKU_AUTHORIZE: admins may do everything, viewers may read."""
    user = session.get("user")
    if user is None:
        abort(401)
    return ROLES[user] == "admin" or (ROLES[user] == "viewer" and action == "read")
