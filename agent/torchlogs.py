"""Two torch.distributed.elastic log lines that mislead trainguard users, handled once here.

* ``Failed to register signal handlers since torchelastic is running on a child thread. This could
  lead to orphaned worker processes if the torchrun is terminated.`` — torch prints it on every
  start because trainguard runs elastic's loop in its supervisor thread (so that SIGTERM is a drain,
  not an abort). Orphans are handled another way: every worker gets a parent-death signal
  (:mod:`trainguard.runtime.shim`), so even ``kill -9`` of the agent takes its workers down. The line
  is dropped and ``orphan_safety`` says so once, in our words.
* ``failed (exitcode: 75) local_rank: ...`` — logged at ERROR when a worker exits with the resize
  code, which is the contract for "checkpoint committed, re-form me", not a failure. Dropped; the
  agent's own ``decision`` line records the resize.
* ``Sending process <pid> closing signal SIGTERM`` — logged at WARNING whenever elastic ends a worker
  that still runs. On a drain or a resize that is the plan, and the agent's own lines say so
  (``decision``, ``workers_terminating`` with its reason and grace), so it is dropped while the agent
  stops its workers as planned (:func:`expected_stop`). After a real failure (a crash, a drain deadline
  that passed before the emergency checkpoint) it stays: there it tells which siblings were ended.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from trainguard.contract.log import get_logger
from trainguard.contract.protocol import EXIT_RESIZE

log = get_logger("trainguard.agent.torchlogs")
ELASTIC_MP_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _ElasticNoise(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Failed to register signal handlers since torchelastic is running on a child thread"):
            if not self.explained:
                self.explained = True
                log.info("orphan_safety", detail="workers are started from the agent's supervisor thread, where "
                         "torch cannot install its signal handlers; instead each worker gets a parent-death "
                         "signal, so the workers die with the agent even on kill -9")
            return False
        if msg.startswith("failed (exitcode: %s)") and record.args and record.args[0] == EXIT_RESIZE:
            return False
        if msg.startswith("Sending process %s closing signal %s") and getattr(_planned, "stop", False):
            return False
        return True


_planned = threading.local()


@contextmanager
def expected_stop(planned: bool = True) -> Iterator[None]:
    """Within it (when ``planned``), elastic ending workers on this thread is the agent's plan (a drain
    or a resize), not a failure: its per-process closing-signal lines are dropped. Elastic ends workers
    on the thread that polls or closes its process context, the agent's supervisor thread."""
    before = getattr(_planned, "stop", False)
    _planned.stop = planned or before
    try:
        yield
    finally:
        _planned.stop = before


_filter = _ElasticNoise()


def install() -> None:
    """Attach the filter to elastic's multiprocessing logger (idempotent)."""
    logger = logging.getLogger(ELASTIC_MP_LOGGER)
    if _filter not in logger.filters:
        logger.addFilter(_filter)
