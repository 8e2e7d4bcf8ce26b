"""structlog set-up: JSON lines when stderr is not a TTY, a readable console renderer when it is.

Event names are stable snake_case (``state_change``, ``checkpoint_committed``); one event per state
transition. Secrets are never passed to a logger: config is redacted before it is logged.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_configured = False


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process.

    ``fmt`` is ``auto`` (JSON unless the stream is a TTY), ``json`` or ``console``.
    """
    global _configured
    stream = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        lvl = logging.INFO
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # torch.distributed.elastic logs through the stdlib; keep its lines, at WARNING and above.
    logging.basicConfig(stream=stream, level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _configured = True


def get_logger(name: str) -> Any:
    """A lazy structlog logger carrying ``component=name``; it picks up :func:`configure` even when
    created at import time, before configuration."""
    return structlog.get_logger(component=name)
