"""``dlrover-run`` on torch 2.13: DLRover 0.6.1 builds torch's ``SubprocessHandler`` (for its local
master) without the ``numa_options`` argument torch 2.13 added, and fails at start. This wrapper passes
``None`` (no NUMA binding, as torch's own default) and runs ``dlrover-run`` with the same arguments."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

from dlrover.trainer.torch import elastic_run


class _Handler(sh.SubprocessHandler):
    def __init__(self, entrypoint, args, env, stdout, stderr, local_rank_id=0, numa_options=None):  # type: ignore[no-untyped-def]
        super().__init__(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)


elastic_run.SubprocessHandler = _Handler

if __name__ == "__main__":
    sys.argv[0] = "dlrover-run"
    sys.exit(elastic_run.main())
