"""The feedback API: FastAPI routes that turn product POSTs into durable feedback events.

    POST /v1/feedback          one event                   -> 202 {"event_id", "stream_seq"}
    POST /v1/feedback:batch    {"events": [...]} (1..N)    -> 202 {"accepted": [...]}
    GET  /healthz, /metrics, /openapi.json, /docs

Each request, in order: a known key (`Authorization: Bearer <key>`, else 401), a body within
`max_body_bytes` (else 413), a valid body (else 422 naming every failing field), every
event's product allowed for the key (else 403), the key's rate, shared by every replica
through the bus (else 429 with Retry-After; 503 when the bus cannot say), then the events,
stamped with the key's name and id, are published to the feedback stream with
`Nats-Msg-Id = event_id` and 202 is answered only once the stream has acknowledged them
(stored on disk). A repeated event id is dropped by the stream's duplicate window and
answered exactly as the first time (the stream's ack names the first copy's sequence). If
the bus cannot store them: 503.

The request body schema is proto's `FeedbackEvent` (through msgspec's JSON Schema), so the
OpenAPI document and the wire contract cannot drift apart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from libs.bus.publisher import Outgoing, Publisher, PublishError
from libs.feedback.auth import KeyStore, Principal
from libs.feedback.rate_limit import SharedStateUnavailable, SharedTokenBucket
from libs.feedback.validation import FeedbackBatch, InvalidBody, parse_batch, parse_event
from proto import subjects
from proto.messages import FeedbackEvent

log = structlog.get_logger(__name__)

API_VERSION = "1"
HEALTHY_STATUSES = frozenset({"ok", "idle"})

REQUESTS = Counter(
    "rlpipe_feedback_requests_total",
    "Feedback API requests by route and status",
    ["route", "status"],
)
EVENTS = Counter(
    "rlpipe_feedback_events_total", "Feedback events acknowledged by the stream", ["outcome"]
)
REQUEST_SECONDS = Histogram(
    "rlpipe_feedback_request_seconds",
    "Time from request to answer, durable ack included",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


class Accepted(msgspec.Struct, kw_only=True):
    """An event the feedback stream has stored (or had already stored: same answer)."""

    event_id: str
    stream_seq: int


class BatchAccepted(msgspec.Struct, kw_only=True):
    """Every event of a batch, stored, in the order posted."""

    accepted: list[Accepted]


class ErrorMessage(msgspec.Struct, kw_only=True):
    """Why a request was refused."""

    detail: str


class FieldProblem(msgspec.Struct, kw_only=True):
    """One failing field: its location in the request (`["body", "events", 3, "signal"]`)."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrors(msgspec.Struct, kw_only=True):
    """Every failing field of a body (422)."""

    detail: list[FieldProblem]


@dataclass(frozen=True)
class ApiLimits:
    """Request limits of the API."""

    max_body_bytes: int = 1024 * 1024
    max_batch_events: int = 500
    # Retry-After of a 503 (the bus could not store the events).
    unavailable_retry_after_s: int = 1


class RequestRefused(Exception):
    """A request answered with an error status; `body` is the JSON to send."""

    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


class FeedbackIngest:
    """What the routes do, apart from HTTP: authenticate, limit, validate, publish."""

    def __init__(
        self,
        keys: KeyStore,
        limiter: SharedTokenBucket,
        publisher: Publisher,
        limits: ApiLimits,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        self.limiter = limiter
        self.publisher = publisher
        self.limits = limits
        self._clock = clock
        self._stored = EVENTS.labels("stored")
        self._duplicate = EVENTS.labels("duplicate")

    def authenticate(self, authorization: str | None) -> Principal:
        scheme, _, key = (authorization or "").partition(" ")
        principal = self.keys.authenticate(key.strip()) if scheme.lower() == "bearer" else None
        if principal is None:
            raise RequestRefused(
                401,
                ErrorMessage(
                    detail="missing or unknown API key: send `Authorization: Bearer <key>`"
                ),
                {"WWW-Authenticate": "Bearer"},
            )
        return principal

    async def read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise self._too_large()
        return bytes(body)

    def _too_large(self) -> RequestRefused:
        return RequestRefused(
            413, ErrorMessage(detail=f"body over {self.limits.max_body_bytes} bytes: split it")
        )

    async def admit(self, principal: Principal, events: list[FeedbackEvent]) -> None:
        """403 for a product the key may not post for, 429 over the key's rate."""
        for event in events:
            if not principal.may_post_for(event.product):
                raise RequestRefused(
                    403,
                    ErrorMessage(
                        detail=f"API key {principal.name!r} may not post feedback for product "
                        f"{event.product!r}"
                    ),
                )
        wait_s = await self._take_rate(principal, len(events))
        if wait_s > 0:
            retry_after = "3600" if math.isinf(wait_s) else str(max(1, math.ceil(wait_s)))
            raise RequestRefused(
                429,
                ErrorMessage(
                    detail=f"API key {principal.name!r} is over its rate of "
                    f"{self.limiter.rate_per_s:g} events/s (burst {self.limiter.burst})"
                ),
                {"Retry-After": retry_after},
            )

    async def _take_rate(self, principal: Principal, num_events: int) -> float:
        try:
            return await self.limiter.take(principal.name, num_events)
        except (SharedStateUnavailable, nats.errors.Error, nats.js.errors.Error) as exc:
            log.error("rate limit state unavailable", error=repr(exc), key=principal.name)
            raise self._unavailable("the rate limit's state") from exc

    def _unavailable(self, what: str) -> RequestRefused:
        return RequestRefused(
            503,
            ErrorMessage(detail=f"{what} is unavailable; retry (same event ids)"),
            {"Retry-After": str(self.limits.unavailable_retry_after_s)},
        )

    async def store(self, principal: Principal, events: list[FeedbackEvent]) -> list[Accepted]:
        """Publish with msg id = event id, stamped with the time and the key; returns once
        the stream acknowledged every one."""
        now = self._clock()
        stamped = [
            msgspec.structs.replace(
                e, received_at=now, key_name=principal.name, key_id=principal.key_id
            )
            for e in events
        ]
        try:
            if len(stamped) == 1:
                acks = [
                    await self.publisher.publish(
                        subjects.FEEDBACK_EVENTS, stamped[0], msg_id=stamped[0].event_id
                    )
                ]
            else:
                acks = await self.publisher.publish_many(
                    Outgoing(subjects.FEEDBACK_EVENTS, e, e.event_id) for e in stamped
                )
        except PublishError as exc:
            log.error("feedback not stored", error=str(exc), num_events=len(stamped))
            raise self._unavailable("the feedback store") from exc
        for ack in acks:
            (self._duplicate if ack.duplicate else self._stored).inc()
        return [
            Accepted(event_id=e.event_id, stream_seq=a.seq)
            for e, a in zip(events, acks, strict=True)
        ]


def create_app(ingest: FeedbackIngest, health: Callable[[], dict[str, Any]]) -> FastAPI:
    """The FastAPI app over `ingest`; `health` is the service's health report."""
    app = FastAPI(
        title="rlpipe feedback API",
        version=API_VERSION,
        description=__doc__,
    )
    app.include_router(feedback_routes(ingest))
    app.include_router(operations_routes(health))
    app.openapi = lambda: _openapi(app, ingest.limits)  # type: ignore[method-assign]
    return app


def feedback_routes(ingest: FeedbackIngest) -> APIRouter:
    """What a product calls: post one event, or a batch stored all together."""
    router = APIRouter()
    post_responses = _post_responses()

    @router.post(
        "/v1/feedback",
        status_code=202,
        summary="Post one feedback event",
        response_class=Response,
        responses=post_responses(Accepted),
        openapi_extra=_request_body("FeedbackEvent"),
    )
    async def post_feedback(request: Request) -> Response:
        return await _handle(request, "one", ingest, single=True)

    @router.post(
        "/v1/feedback:batch",
        status_code=202,
        summary="Post many feedback events (all stored, or none answered 202)",
        response_class=Response,
        responses=post_responses(BatchAccepted),
        openapi_extra=_request_body("FeedbackBatch"),
    )
    async def post_feedback_batch(request: Request) -> Response:
        return await _handle(request, "batch", ingest, single=False)

    return router


def operations_routes(health: Callable[[], dict[str, Any]]) -> APIRouter:
    """What the operators read: the health check and the Prometheus metrics."""
    router = APIRouter()

    @router.get(
        "/healthz",
        summary="Service health: 200 when ok, 503 otherwise",
        response_class=Response,
        responses={
            200: _json_content({"type": "object"}, "Healthy"),
            503: _json_content({"type": "object"}, "Unhealthy"),
        },
    )
    async def healthz() -> Response:
        report = health()
        status = 200 if report.get("status") in HEALTHY_STATUSES else 503
        return _json(status, report)

    @router.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return router


async def _handle(request: Request, route: str, ingest: FeedbackIngest, single: bool) -> Response:
    started = time.perf_counter()
    try:
        principal = ingest.authenticate(request.headers.get("authorization"))
        body = await ingest.read_body(request)
        if single:
            events = [parse_event(body)]
        else:
            events = parse_batch(body, ingest.limits.max_batch_events)
        await ingest.admit(principal, events)
        accepted = await ingest.store(principal, events)
        response = _json(202, accepted[0] if single else BatchAccepted(accepted=accepted))
    except InvalidBody as exc:
        response = _json(422, {"detail": [e.as_dict() for e in exc.errors]})
    except RequestRefused as exc:
        response = _json(exc.status, exc.body, exc.headers)
    REQUESTS.labels(route, str(response.status_code)).inc()
    REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
    return response


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# --- OpenAPI --------------------------------------------------------------------------------

_COMPONENT_TYPES = (
    FeedbackEvent,
    FeedbackBatch,
    Accepted,
    BatchAccepted,
    ErrorMessage,
    ValidationErrors,
)
_REF = "#/components/schemas/{name}"
SECURITY_SCHEME = "apiKey"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json_content(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _request_body(component: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(component)}},
        },
        "security": [{SECURITY_SCHEME: []}],
    }


def _post_responses() -> Callable[[type[msgspec.Struct]], dict[int | str, dict[str, Any]]]:
    def responses(accepted: type[msgspec.Struct]) -> dict[int | str, dict[str, Any]]:
        error = _ref("ErrorMessage")
        return {
            202: _json_content(_ref(accepted.__name__), "Stored in the feedback stream"),
            401: _json_content(error, "Missing or unknown API key"),
            403: _json_content(error, "The key may not post feedback for this product"),
            413: _json_content(error, "Body over the size limit"),
            422: _json_content(_ref("ValidationErrors"), "Invalid body; every failing field"),
            429: _json_content(error, "Over the key's rate; see Retry-After"),
            503: _json_content(error, "The feedback store is unavailable; retry"),
        }

    return responses


def _openapi(app: FastAPI, limits: ApiLimits) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, components = msgspec.json.schema_components(_COMPONENT_TYPES, ref_template=_REF)
    events = components["FeedbackBatch"]["properties"]["events"]
    events.update(minItems=1, maxItems=limits.max_batch_events)
    schema.setdefault("components", {})["schemas"] = components
    schema["components"]["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "The product's API key: `Authorization: Bearer <key>`",
        }
    }
    app.openapi_schema = schema
    return schema
