"""The tiny job under nvidia-resiliency-ext's ``ft_launcher``: the plain torchrun job (DDP, ``torch.save``
every K steps, restored on every restart) plus its fault-tolerance API, a ``RankMonitorClient``
heartbeat after every step, which is how the launcher detects a hung rank."""

from __future__ import annotations

import torchrun_job
from nvidia_resiliency_ext import fault_tolerance as ft


def main() -> None:
    client = ft.RankMonitorClient()
    client.init_workload_monitoring()
    try:
        torchrun_job.main(__doc__, on_step=client.send_heartbeat)
    finally:
        client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
