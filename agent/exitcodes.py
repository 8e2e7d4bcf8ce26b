"""The exit-code contract between a worker and its agent.

* ``0`` — the job finished on this rank.
* :data:`RESIZE` (75, ``EX_TEMPFAIL``) — "a checkpoint of the current step is committed; restart me
  at the new world size". The worker runtime exits with it after an emergency (drain) or resize
  checkpoint. It never consumes one of ``workers.max_restarts``.
* anything else, or death by a signal the agent did not send — a crash: it consumes a restart.

When one local worker exits, torch.distributed.elastic's process context terminates its siblings
(SIGTERM), so a node whose workers resized reports one ``75`` and some ``-15``: that still is a
resize, because every rank committed the checkpoint before any of them exited.
"""

from __future__ import annotations

import signal

RESIZE = 75
SUCCESS = 0
# Codes the process context reports for siblings it terminated after the first worker exited.
_TERMINATED_BY_AGENT = {-int(signal.SIGTERM), -int(signal.SIGKILL), 128 + int(signal.SIGTERM)}


def classify(exit_codes: list[int]) -> str:
    """Classify a finished worker group by its exit codes: ``success``, ``resize`` or ``crash``."""
    if not exit_codes:
        return "success"
    if all(c == SUCCESS for c in exit_codes):
        return "success"
    if RESIZE in exit_codes and all(c in (RESIZE, SUCCESS) or c in _TERMINATED_BY_AGENT for c in exit_codes):
        return "resize"
    return "crash"
