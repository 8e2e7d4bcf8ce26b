"""A plain torchrun-style worker (no trainguard API) that records who sends it SIGTERM.

Usage: ``_sigterm_probe.py RECORD_FILE``. It all-reduces a tensor over gloo every 50 ms (printing
``{"event": "train_step", ...}`` now and then) and, on SIGTERM, appends ``{"pid", "sender"}`` to
RECORD_FILE, then dies of the signal like any script that does not handle it. SIGTERM is blocked in
every thread and taken by ``sigwaitinfo`` in one, which is how the sender's pid is known.
"""

import json
import os
import signal
import sys
import threading
import time

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before any thread exists: all inherit it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def on_sigterm(record: str) -> None:
    info = signal.sigwaitinfo({signal.SIGTERM})
    with open(record, "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "sender": info.si_pid}) + "\n")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # its disposition is still the default
    os.kill(os.getpid(), signal.SIGTERM)  # die of it, as an unmodified script would


def main() -> None:
    threading.Thread(target=on_sigterm, args=(sys.argv[1],), daemon=True).start()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    t = torch.ones(1)
    step = 0
    while True:
        dist.all_reduce(t)
        step += 1
        if dist.get_rank() == 0 and step % 10 == 0:
            print(json.dumps({"event": "train_step", "step": step, "world_size": world}), flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
