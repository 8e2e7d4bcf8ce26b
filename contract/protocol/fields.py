"""One field off the wire or out of the environment, checked: :class:`ProtocolError` names the field,
the value and what it must be. A part of :mod:`trainguard.contract.protocol`."""

from __future__ import annotations

import math
from enum import Enum
from typing import Any


class ProtocolError(ValueError):
    """A malformed control message or environment variable; the text says which field and why."""


def _finite(name: str, v: Any, *, positive: bool = False, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"`{name}` must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise ProtocolError(f"`{name}` must be finite, got {v!r}")
    if positive and f <= 0:
        raise ProtocolError(f"`{name}` must be > 0, got {v!r}")
    return f


def _int(name: str, v: Any, *, minimum: int | None = None, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"`{name}` must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise ProtocolError(f"`{name}` must be >= {minimum}, got {v!r}")
    return v


def _str(name: str, v: Any, *, limit: int = 200) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"`{name}` must be a string, got {v!r}")
    return v[:limit]


def _enum(name: str, cls: type[Enum], v: Any) -> Any:
    """``cls(v)``, or a :class:`ProtocolError` naming the field and the values it takes."""
    try:
        return cls(v)
    except ValueError:
        raise ProtocolError(f"`{name}` must be one of {[m.value for m in cls]}, got {v!r}") from None
