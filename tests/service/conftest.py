"""Fixtures for the service tests (sd_notify, the store, systemd units, Docker, etcd)."""

from __future__ import annotations

from tests.fixtures.etcd import EtcdServer, etcd_server  # noqa: F401  (fixture re-export)
from tests.fixtures.slurm import SlurmCluster, slurm_cluster  # noqa: F401,E402  (fixture re-export)
