"""The one backoff policy of the checkpoint subsystem, and a retry loop built on it.

:class:`Backoff` says how long to wait before attempt ``n + 1`` and whether there is room for it
(attempts and a total deadline). Everything that retries uses it: :meth:`Storage.retry` for small
storage operations, the manager's collective whole-save retry (where all ranks must agree, so it
drives the policy itself), and restore's "unreadable now, try again until the deadline" loop.

Jitter comes from a private generator: drawing from the global :mod:`random` would perturb the
training script's RNG stream (and break bit-identical resumption).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_jitter = random.Random()


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter, bounded by attempts and by a total deadline."""

    base_s: float = 0.1
    """Delay before the second attempt (seconds), doubled for each further attempt."""
    max_s: float = 5.0
    """Upper bound of one delay (seconds)."""
    attempts: int = 5
    """Attempts in all (the first one included); a huge value means "until the deadline"."""
    deadline_s: float = 120.0
    """Total time budget from the first attempt (seconds)."""
    jitter: bool = True
    """Scale each delay by a random factor in [0.5, 1) so that ranks and nodes do not retry in lockstep."""

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.max_s < 0 or self.deadline_s < 0 or self.attempts < 1:
            raise ValueError(f"invalid backoff {self!r}: delays and deadline must be >= 0, attempts >= 1")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        d = min(self.max_s, self.base_s * 2 ** min(attempt - 1, 60))
        return d * (0.5 + _jitter.random() / 2) if self.jitter else d

    def allows(self, attempt: int, elapsed_s: float, delay_s: float) -> bool:
        """Whether another attempt fits after ``attempt`` failed ones, ``elapsed_s`` in, waiting ``delay_s``."""
        return attempt < self.attempts and elapsed_s + delay_s <= self.deadline_s

    @classmethod
    def until(cls, deadline_s: float, *, base_s: float = 0.5, max_s: float = 10.0) -> Backoff:
        """A policy bounded by time only (restore's "retry until the deadline")."""
        return cls(base_s=base_s, max_s=max_s, attempts=2**31, deadline_s=deadline_s)


def retry_call(fn: Callable[[], T], backoff: Backoff, *, transient: Callable[[BaseException], bool],
               on_failure: Callable[[BaseException, int, float, bool, bool], None] | None = None,
               sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """Call ``fn`` until it returns, retrying errors that ``transient`` accepts within ``backoff``.

    ``on_failure(exc, attempt, elapsed_s, transient, giving_up)`` is called for every failed attempt
    (logging); the last error is re-raised as it is when the policy runs out or the error is not
    transient. ``sleep``/``clock`` are injectable for tests.
    """
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified by `transient`, re-raised when not retried
            is_transient = transient(e)
            elapsed = clock() - start
            delay = backoff.delay(attempt)
            give_up = not is_transient or not backoff.allows(attempt, elapsed, delay)
            if on_failure is not None:
                on_failure(e, attempt, elapsed, is_transient, give_up)
            if give_up:
                raise
            sleep(delay)


__all__ = ["Backoff", "retry_call"]
