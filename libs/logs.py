"""Structured logging, configured once in a service's main (never at import).

JSON lines when stderr is not a terminal (or when asked), readable lines on a terminal.
Every line carries the service name; `bind_context` adds fields such as the policy version.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Send structlog and stdlib logging to stderr, with `service` on every line."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    numeric_level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that use stdlib logging (nats, uvicorn) go to stderr at the same level.
    logging.basicConfig(
        level=numeric_level, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )


def bind_context(**fields: Any) -> None:
    """Add fields (e.g. policy_version=3) to every following log line of this task."""
    structlog.contextvars.bind_contextvars(**fields)
