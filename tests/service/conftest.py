"""Fixtures for the service tests (sd_notify, the store, systemd units, Docker, etcd)."""

from __future__ import annotations

from tests.fixtures.etcd import EtcdServer, etcd_server  # noqa: F401  (fixture re-export)
