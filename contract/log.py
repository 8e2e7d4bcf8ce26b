"""structlog set-up: JSON lines when stderr is not a TTY, a readable console renderer when it is.

A worker's stderr is a log file the agent tees to its own output, so the agent passes the format it
decided to its workers (:attr:`RuntimeEnv.log_format <trainguard.contract.protocol.RuntimeEnv.log_format>`):
worker lines and agent lines look alike on a terminal.

Event names are stable snake_case (``state_change``, ``checkpoint_committed``); one event per state
transition. Secrets are never passed to a logger: config is redacted before it is logged.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_configured = False
_rendered = ""
"""What :func:`configure` decided: ``json`` or ``console`` (empty before it ran)."""


def resolve_format(fmt: str, stream: TextIO) -> str:
    """``json`` or ``console`` for ``fmt`` (``auto``: JSON unless ``stream`` is a TTY)."""
    if fmt in ("json", "console"):
        return fmt
    return "console" if stream.isatty() else "json"


def rendered_format() -> str:
    """The format this process's lines are rendered in (``json``/``console``; empty before
    :func:`configure`). The agent hands it to its workers, whose output it tees to its own."""
    return _rendered


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process.

    ``fmt`` is ``auto`` (JSON unless the stream is a TTY), ``json`` or ``console``.
    """
    global _configured, _rendered
    stream = stream or sys.stderr
    _rendered = resolve_format(fmt, stream)
    use_json = _rendered == "json"
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
        # One write call per line (structlog's PrintLogger makes two: the text, then "\n"): the agent's
        # stderr also carries its workers' tee'd lines, written by other threads, and with
        # PYTHONUNBUFFERED=1 (the systemd unit, the image) one landed between the two, gluing a worker's
        # event to the agent's: two JSON lines no collector could parse (tests/agent/test_log_lines.py).
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # torch.distributed.elastic logs through the stdlib; keep its lines, at WARNING and above.
    logging.basicConfig(stream=stream, level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _configured = True


def get_logger(name: str) -> Any:
    """A lazy structlog logger carrying ``component=name``; it picks up :func:`configure` even when
    created at import time, before configuration."""
    return structlog.get_logger(component=name)
