"""An approval gate's decision form, made from the gate's JSON Schema (issue 36 item 2), free
of any web framework.

What a form can show is shown as one (``form_of``):

- a **boolean** (the schema ``{"type": "boolean"}``, or the only boolean property of an
  object) is two buttons, **Approve** (``true``) and **Reject** (``false``);
- an **enum** (or a ``const``) is a choice of its values, and so is any other boolean
  property (yes / no);
- a **string**, a **number** and an **integer** are fields of that type, with the
  schema's bounds (``minimum``/``maximum``, ``minLength``/``maxLength``) and ``default``;
- an **object** of such properties is those fields, its ``required`` ones required.

Anything else (no schema, nested objects, arrays, ``anyOf``, ``$ref``, a list of types, a
keyword the form does not know) is the raw JSON textarea, as before. The form only helps
to type a decision: ``read`` turns the posted fields into the decision, and
``pikku.approve`` still checks it against the schema (``jsonschema``) and the approvers,
as it checks a decision typed as JSON.

The posted fields are ``field-<i>`` (the i-th field, so a property's name never becomes a
form field's name) and ``verdict`` (``true``/``false``: the button pressed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pikku_celery.contrib._access import APPROVE, Caller
from pikku_celery.model.errors import InvalidInputError, WorkflowApprovalError
from pikku_celery.operate.timeline import GateView

#: Kinds of field: a text field, a number (``integer``: whole), a choice of values.
TEXT, NUMBER, INTEGER, CHOICE = "text", "number", "integer", "choice"
#: The form field of the Approve / Reject buttons.
VERDICT_FIELD = "verdict"
#: Keywords a property may have and still be a field (others: the JSON textarea).
_SCALAR_KEYS = frozenset({
    "type", "title", "description", "enum", "const", "default", "examples", "$comment",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format"})
#: Keywords an object schema may have and still be a form.
_OBJECT_KEYS = frozenset({
    "type", "title", "description", "properties", "required", "additionalProperties",
    "$schema", "$id", "$comment", "examples"})
#: A ``default`` that is absent (``None`` is a value an ``enum`` can hold).
_NONE = object()
MAX_FIELDS = 20
MAX_CHOICES = 100
#: A string ``format`` shown by the browser's own field of that type.
_INPUT_TYPES = {"email": "email", "uri": "url", "date": "date"}


@dataclass(frozen=True)
class Field:
    """One field of a decision form: ``name`` is the property it fills (``None``: the
    decision itself); ``choices`` the labels of ``values`` (a ``CHOICE``); ``attrs`` the
    HTML attributes from the schema's bounds; ``default`` the text (or the index of the
    choice) first shown."""

    key: str
    name: str | None
    kind: str
    label: str
    required: bool
    description: str | None = None
    choices: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()
    attrs: tuple[tuple[str, str], ...] = ()
    default: str = ""


@dataclass(frozen=True)
class DecisionForm:
    """A gate's form: ``fields`` and, when the schema has one boolean, the ``verdict``
    field answered by the Approve / Reject buttons; neither: the JSON textarea."""

    fields: tuple[Field, ...] = ()
    verdict: Field | None = None

    @property
    def raw(self) -> bool:
        """Whether the decision is typed as JSON (no form can show the schema)."""
        return not self.fields and self.verdict is None


RAW = DecisionForm()
#: Why a caller cannot decide a gate with approvers when the server cannot tell who they
#: are, and what to do about it.
UNNAMED = ("only its approvers may decide it, and this server cannot tell who you are: "
           "serve `pikku dashboard --identity-header NAME` behind a proxy that signs users "
           "in and sets that header, or decide it on the dashboard mounted in your app, "
           "which identifies its users (Flask: PIKKU_IDENTIFY; Django: the signed-in user)")


@dataclass(frozen=True)
class Refusal:
    """A decision ``pikku.approve`` refused, shown on the run page with what was typed:
    ``decision`` as JSON, or the form's ``fields`` (``read``)."""

    gate: str
    message: str
    decision: str
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class GateForm:
    """An approval gate on the run page: ``form`` when the caller may decide it here
    (``shape``: the fields its schema makes, ``form_of``), else ``why_not`` (``None`` too
    when it waits no more)."""

    gate: GateView
    form: bool
    why_not: str | None
    refusal: Refusal | None = None
    shape: DecisionForm = RAW


class Asking(Protocol):
    """What ``gate_form`` reads of the request (``_pages.View``)."""

    @property
    def csrf(self) -> tuple[str, str] | None: ...

    @property
    def caller(self) -> Caller: ...

    def can(self, action: str, run_id: str | None, gate: str | None = None,
            **about: Any) -> bool: ...


def gate_form(view: Asking, run_id: str, gate: GateView, refusal: Refusal | None
              ) -> GateForm:
    """Whether the caller gets a decision form for ``gate``, or why not."""
    refused = refusal if refusal is not None and refusal.gate == gate.name else None
    if not gate.waiting:
        return GateForm(gate, False, None)
    if view.csrf is None:
        return GateForm(gate, False, "no forms here (the app has no SECRET_KEY)")
    if not view.can(APPROVE, run_id, gate.name):
        return GateForm(gate, False, "you may not decide this approval")
    if gate.approvers is not None:
        who = view.caller.name()
        if who is None:
            return GateForm(gate, False, UNNAMED)
        if who not in gate.approvers:
            return GateForm(gate, False, f"only its approvers may decide it; you are {who}")
    return GateForm(gate, True, None, refused, form_of(gate.schema))


def schema_of(gates: Sequence[GateView], run_id: str, name: str) -> Any:
    """The schema of the gate ``name`` a form decides: the one waiting, else the last
    reached (``pikku.approve`` then says why it is not open); a gate the run has not
    reached has no form."""
    found = [g for g in gates if g.name == name]
    if not found:
        raise WorkflowApprovalError(run_id, name, "the run does not wait on this approval "
                                                  "(it has not reached it)")
    return next((g for g in reversed(found) if g.waiting), found[-1]).schema


def form_of(schema: Any) -> DecisionForm:
    """The form showing ``schema`` (``RAW``: none can)."""
    if not isinstance(schema, dict):
        return RAW  # None (any decision), True, False, a schema kept as text
    if _is_boolean(schema):
        return DecisionForm(verdict=Field(VERDICT_FIELD, None, CHOICE, "decision", True,
                                          _text(schema.get("description"))))
    if schema.get("type") == "object" or ("properties" in schema and "type" not in schema):
        return _object_form(schema)
    field = _field("field-0", None, schema, required=True, label="decision")
    return RAW if field is None else DecisionForm(fields=(field,))


def _object_form(schema: dict[str, Any]) -> DecisionForm:
    properties = schema.get("properties")
    required = schema.get("required", [])
    if (set(schema) - _OBJECT_KEYS or not isinstance(properties, dict)
            or not 0 < len(properties) <= MAX_FIELDS or not isinstance(required, list)
            or set(required) - set(properties)):
        return RAW  # a required property the form has no field for: never satisfiable
    booleans = [name for name, sub in properties.items()
                if isinstance(sub, dict) and _is_boolean(sub)]
    verdict = booleans[0] if len(booleans) == 1 else None
    fields: list[Field] = []
    verdict_field = None
    # The required fields first, each group in the schema's order.
    ordered = sorted(properties.items(), key=lambda item: item[0] not in required)
    for name, sub in ordered:
        if not isinstance(name, str) or not isinstance(sub, dict):
            return RAW
        label = _text(sub.get("title")) or name
        if name == verdict:
            verdict_field = Field(VERDICT_FIELD, name, CHOICE, label, True,
                                  _text(sub.get("description")))
            continue
        field = _field(f"field-{len(fields)}", name, sub, required=name in required,
                       label=label)
        if field is None:
            return RAW
        fields.append(field)
    return DecisionForm(tuple(fields), verdict_field)


def _is_boolean(schema: dict[str, Any]) -> bool:
    """A plain boolean: Approve / Reject (a ``const`` or an ``enum`` is a choice)."""
    return (schema.get("type") == "boolean" and not set(schema) & {"enum", "const"}
            and not set(schema) - _SCALAR_KEYS)


def _field(key: str, name: str | None, schema: dict[str, Any], *, required: bool,
           label: str) -> Field | None:
    """The field of a scalar ``schema``, or ``None`` when a field cannot show it."""
    if set(schema) - _SCALAR_KEYS:
        return None
    kind = schema.get("type")
    description = _text(schema.get("description"))
    values = _values(schema)
    if values is not None:
        if not values or len(values) > MAX_CHOICES:
            return None
        default = schema.get("default", _NONE)
        chosen = next((str(i) for i, v in enumerate(values) if _same(v, default)), "")
        return Field(key, name, CHOICE, label, required, description,
                     tuple(v if isinstance(v, str) else json.dumps(v) for v in values),
                     tuple(values), default=chosen)
    if kind == "boolean":
        chosen = {True: "0", False: "1"}.get(schema["default"], "") if isinstance(
            schema.get("default"), bool) else ""
        return Field(key, name, CHOICE, label, required, description, ("yes", "no"),
                     (True, False), default=chosen)
    if kind == "string":
        attrs = [("type", _INPUT_TYPES.get(str(schema.get("format")), "text"))]
        attrs += [(html, str(schema[k])) for k, html in (("minLength", "minlength"),
                                                         ("maxLength", "maxlength"))
                  if _is_number(schema.get(k))]
        default = schema.get("default")
        return Field(key, name, TEXT, label, required, description, attrs=tuple(attrs),
                     default=default if isinstance(default, str) else "")
    if kind in (NUMBER, INTEGER):
        attrs = [("type", "number"), ("step", "1" if kind == INTEGER else "any")]
        attrs += [(html, _number_text(schema[k])) for k, html in (("minimum", "min"),
                                                                  ("maximum", "max"))
                  if _is_number(schema.get(k))]
        default = schema.get("default")
        return Field(key, name, kind, label, required, description, attrs=tuple(attrs),
                     default=_number_text(default) if _is_number(default) else "")
    return None


def _values(schema: dict[str, Any]) -> list[Any] | None:
    """The values an ``enum`` (or a ``const``) allows, or ``None``: neither; ``[]`` when
    a value is not a scalar (a choice cannot show it)."""
    if "const" in schema:
        found = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        found = list(schema["enum"])
    else:
        return None
    if not all(v is None or isinstance(v, str | int | float | bool) for v in found):
        return []
    return found


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number_text(value: Any) -> str:
    return json.dumps(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# --- what was posted --------------------------------------------------------------------


def typed(form: DecisionForm, posted: Mapping[str, str]) -> dict[str, str]:
    """The form's fields as typed (shown again when the decision is refused)."""
    return {f.key: posted.get(f.key) or "" for f in form.fields}


def read(form: DecisionForm, posted: Mapping[str, str]) -> Any:
    """The decision the posted fields make. An empty field is left out (its property
    absent: a required one is then refused by the schema, with its name). Raises
    ``InvalidInputError`` for a field its type cannot take, or no button pressed."""
    if form.raw:
        raise InvalidInputError("no decision was given: type one, as JSON")
    texts = typed(form, posted)
    if form.verdict is not None and form.verdict.name is None:
        return _verdict(posted)  # the decision is the boolean itself
    if form.fields and form.fields[0].name is None:
        return _value(form.fields[0], texts[form.fields[0].key])  # one scalar
    decision: dict[str, Any] = {}
    for field in form.fields:
        if texts[field.key] != "":
            decision[str(field.name)] = _value(field, texts[field.key])
    if form.verdict is not None:
        decision[str(form.verdict.name)] = _verdict(posted)
    return decision


def _verdict(posted: Mapping[str, str]) -> bool:
    said = posted.get(VERDICT_FIELD)
    if said not in ("true", "false"):
        raise InvalidInputError("no decision was given: press Approve or Reject")
    return said == "true"


def _value(field: Field, text: str) -> Any:
    label = field.name or "the decision"
    if field.kind == CHOICE:
        if not re.fullmatch(r"[0-9]{1,4}", text) or int(text) >= len(field.values):
            raise InvalidInputError(f"{label}: choose one of its values")
        return field.values[int(text)]
    if field.kind in (NUMBER, INTEGER):
        try:
            number = json.loads(text.strip())
        except ValueError:
            number = None
        if not _is_number(number) or not math.isfinite(number):
            raise InvalidInputError(f"{label}: {text[:60]!r} is not a number")
        if field.kind == INTEGER:
            if number != int(number):
                raise InvalidInputError(f"{label}: {text[:60]!r} is not a whole number")
            number = int(number)
        return number
    return text
