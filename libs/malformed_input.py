"""Malformed input: the exceptions a decoder of bytes we do not control raises, and why.

    try:
        document = json.loads(body)
    except MALFORMED_INPUT_ERRORS as exc:
        raise BadRequest(f"not valid JSON: {describe_malformed(exc)}") from None

Decoders raise more than their own error class on hostile input. msgspec and the standard
`json` module raise `RecursionError` on input nested deeper than the interpreter's recursion
limit (a 400 KB body of `[[[[...`), and `RecursionError` is not a `ValueError`: a decoder
that catches only its decode error lets it through, which is a 500 on HTTP and, on the bus,
a message that is neither acked nor dead-lettered. Every other decode error of msgspec,
json, orjson, tomllib and pydantic is a `ValueError`.

Every decoder of untrusted input catches these and refuses normally: bus messages
(libs.bus.wire, then a dead letter with the reason), the feedback API's bodies
(libs.feedback.validation, 422), the serve API's (orjson, whose own depth limit raises a
`ValueError`: 400), what model code prints (libs.domains.coding.grading) and the dataset and
transcript files users bring.
"""

from __future__ import annotations

MALFORMED_INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, RecursionError)


def describe_malformed(exc: BaseException) -> str:
    """Why the input was refused, in words a sender can act on."""
    if isinstance(exc, RecursionError):
        return "nested deeper than the decoder allows"
    return str(exc) or type(exc).__name__
