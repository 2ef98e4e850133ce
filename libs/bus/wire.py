"""Messages to and from bytes: msgpack bodies and the headers that describe them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

from libs.malformed_input import describe_malformed
from proto.messages import Message
from proto.validation import check_message

SCHEMA_HEADER = "Rlpipe-Schema"
MSG_ID_HEADER = "Nats-Msg-Id"
DEAD_REASON_HEADER = "Rlpipe-Dead-Reason"
DEAD_ORIGIN_HEADER = "Rlpipe-Dead-Origin"
DEAD_ERROR_HEADER = "Rlpipe-Dead-Error"

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


class InvalidMessage(ValueError):
    """A message that can never be handled: wrong schema, undecodable, or invalid fields.

    `reason` is the dead-letter reason: "schema_mismatch", "undecodable" or "invalid".
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def headers_for(message: Message, msg_id: str) -> dict[str, str]:
    """Headers every published message carries: dedup id and schema id."""
    return {MSG_ID_HEADER: msg_id, SCHEMA_HEADER: message.schema_id()}


def decode(message_type: type[M], data: bytes, headers: Mapping[str, str] | None) -> M:
    """Decode `data` as `message_type`, refusing a schema the header says is different.

    A missing header is accepted (other-language producers may omit it); a header naming
    another type, or a newer major version than this code knows, is refused. A decoded
    message is then checked against its type's invariants (proto.validation): one that
    breaks them is "invalid" like one of the wrong shape. Every failure is an InvalidMessage,
    whatever the decoder raised (msgspec raises RecursionError on deeply nested input), so
    a consumer can always dead-letter what it cannot read.
    """
    schema = (headers or {}).get(SCHEMA_HEADER)
    if schema is not None and schema != message_type.schema_id():
        raise InvalidMessage(
            "schema_mismatch",
            f"expected {message_type.schema_id()}, message says {schema}",
        )
    name = message_type.__name__
    try:
        message = msgspec.msgpack.decode(data, type=message_type)
    except msgspec.ValidationError as exc:
        raise InvalidMessage("invalid", f"{name}: {exc}") from exc
    except Exception as exc:  # DecodeError, RecursionError (nested too deep), anything else:
        # one that escaped would leave the message neither acked nor dead-lettered.
        raise InvalidMessage("undecodable", f"{name}: {describe_malformed(exc)}") from exc
    try:
        check_message(message)
    except Exception as exc:  # InvalidValue, or a check tripped by a value it did not foresee
        raise InvalidMessage("invalid", f"{name}: {describe_malformed(exc)}") from exc
    return message
