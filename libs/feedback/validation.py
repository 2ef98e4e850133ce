"""JSON request bodies to proto `FeedbackEvent`s, or the list of every field that fails.

The fast path is one msgspec decode straight into the proto struct (the schema is proto's,
not written twice). Only when it fails are the fields checked one by one, so a 422 names
every failing field, FastAPI style: `{"loc": ["body", "events", 3, "signal"], "msg": ...}`.
Whatever the decoder raises on a malformed body (a body nested too deep raises
RecursionError: libs.malformed_input) is an InvalidBody, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import msgspec

from libs.malformed_input import MALFORMED_INPUT_ERRORS, describe_malformed
from proto.messages import FeedbackEvent

MAX_REPORTED_ERRORS = 50

_EVENT_FIELDS = msgspec.structs.fields(FeedbackEvent)
_decode_event = msgspec.json.Decoder(FeedbackEvent).decode


class FeedbackBatch(msgspec.Struct, kw_only=True):
    """Body of POST /v1/feedback:batch."""

    events: list[FeedbackEvent]


_decode_batch = msgspec.json.Decoder(FeedbackBatch).decode


@dataclass(frozen=True)
class FieldError:
    """One failing field: where (FastAPI's `loc`), what is wrong, and the error kind."""

    loc: tuple[str | int, ...]
    msg: str
    type: str

    def as_dict(self) -> dict[str, Any]:
        return {"loc": list(self.loc), "msg": self.msg, "type": self.type}


class InvalidBody(ValueError):
    """A body that is not what the endpoint takes; `errors` names every failing field."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, e.loc))}: {e.msg}" for e in errors))
        self.errors = errors[:MAX_REPORTED_ERRORS]


def parse_event(body: bytes) -> FeedbackEvent:
    """One event from a JSON body; raises InvalidBody."""
    try:
        return _decode_event(body)
    except MALFORMED_INPUT_ERRORS:  # RecursionError too: a body nested too deep
        pass
    raise InvalidBody(_event_errors(_json_or_raise(body), ("body",)))


def parse_batch(body: bytes, max_events: int) -> list[FeedbackEvent]:
    """The events of a `{"events": [...]}` JSON body (1 to `max_events`); raises InvalidBody."""
    try:
        events = _decode_batch(body).events
    except MALFORMED_INPUT_ERRORS:
        document = _json_or_raise(body)
        raise InvalidBody(_batch_errors(document)) from None
    if not 1 <= len(events) <= max_events:
        raise InvalidBody(
            [
                FieldError(
                    ("body", "events"),
                    f"a batch holds 1 to {max_events} events, this one {len(events)}",
                    "value_error.list_length",
                )
            ]
        )
    return events


def _json_or_raise(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except MALFORMED_INPUT_ERRORS as exc:
        raise InvalidBody(
            [FieldError(("body",), f"not valid JSON: {describe_malformed(exc)}", "json_invalid")]
        ) from None


def _batch_errors(document: Any) -> list[FieldError]:
    if not isinstance(document, dict):
        return [FieldError(("body",), "expected an object with an `events` list", "type_error")]
    events = document.get("events")
    if not isinstance(events, list):
        kind = "missing" if "events" not in document else "type_error"
        return [FieldError(("body", "events"), "expected a list of feedback events", kind)]
    errors: list[FieldError] = []
    for index, raw in enumerate(events):
        errors += _event_errors(raw, ("body", "events", index))
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
    return errors or [FieldError(("body",), "invalid batch", "value_error")]


def _event_errors(raw: Any, loc: tuple[str | int, ...]) -> list[FieldError]:
    """Every failing field of one event (decoded JSON), each with its message."""
    if not isinstance(raw, dict):
        return [FieldError(loc, "expected a feedback event object", "type_error")]
    errors: list[FieldError] = []
    for field in _EVENT_FIELDS:
        if field.encode_name not in raw:
            if field.required:
                errors.append(FieldError((*loc, field.encode_name), "field required", "missing"))
            continue
        try:
            msgspec.convert(raw[field.encode_name], field.type)
        except MALFORMED_INPUT_ERRORS as exc:
            errors.append(
                FieldError((*loc, field.encode_name), _explain(exc, field.type), "value_error")
            )
    if not errors:  # defensive: the whole-object decode failed for a reason no field shows
        try:
            msgspec.convert(raw, FeedbackEvent)
        except MALFORMED_INPUT_ERRORS as exc:
            errors.append(FieldError(loc, describe_malformed(exc), "value_error"))
    return errors


def _explain(exc: Exception, field_type: Any) -> str:
    """msgspec's message, plus the allowed values of an enumeration."""
    if get_origin(field_type) is Literal:
        return f"{exc}; one of: {', '.join(map(str, get_args(field_type)))}"
    return describe_malformed(exc)
