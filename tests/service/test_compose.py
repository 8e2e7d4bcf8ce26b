"""``docker/compose.yaml`` hangs together: services, mounted files, config and dashboard wiring.

No engine needed: this parses the files. The configs the image and the compose agents use are
validated with the real config loader, so a renamed key fails here, not at ``compose up``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_services(compose: dict) -> None:
    services = compose["services"]
    agents = [s for s in services if s.startswith("agent")]
    assert 2 <= len(agents) <= 3
    for name in ("store", "s3", "prometheus", "grafana"):
        assert name in services
    assert services["store"]["command"][0] == "store"
    for a in agents:
        svc = services[a]
        assert svc["init"] is True
        assert svc["stop_grace_period"] == "150s"
        assert svc["environment"]["TRAINGUARD_RENDEZVOUS_IS_HOST"] == "false"


def test_bind_mount_sources_exist(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).resolve().exists(), f"{name}: {src} does not exist"


@pytest.mark.parametrize("path", ["agent.yaml", "compose-agent.yaml"])
def test_configs_load(path: str) -> None:
    configload = pytest.importorskip("trainguard.agent.configload")
    cfg = configload.load_config(str(DOCKER / path), env={})
    assert cfg.metrics.bind_address == "0.0.0.0" and cfg.metrics.port == 9400


def test_compose_agents_never_host_the_store() -> None:
    configload = pytest.importorskip("trainguard.agent.configload")
    cfg = configload.load_config(str(DOCKER / "compose-agent.yaml"), env={})
    assert cfg.rendezvous.backend == "c10d" and cfg.rendezvous.is_host is False
    assert cfg.rendezvous.endpoint == "store:29400"


def test_grafana_dashboard_and_datasource_wiring(compose: dict) -> None:
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = ds["datasources"][0]["uid"]
    entry = " ".join(compose["services"]["grafana"]["entrypoint"])
    assert f"/{uid}/g" in entry  # the export-format placeholder is rewritten to this uid
    dashboards = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/trainguard.yaml").read_text())
    assert dashboards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    board = REPO / "metrics/dashboards/trainguard.json"
    if not board.exists():
        pytest.skip("metrics/dashboards/trainguard.json not written yet")
    text = board.read_text()
    json.loads(text)
    uids = {p.get("datasource", {}).get("uid") for p in json.loads(text).get("panels", []) if isinstance(p.get("datasource"), dict)}
    assert uids <= {"${DS_PROMETHEUS}", uid, None}, uids


def test_prometheus_scrapes_the_compose_agents(compose: dict) -> None:
    prom = yaml.safe_load((DOCKER / "prometheus/prometheus.yml").read_text())
    targets = {t for sc in prom["scrape_configs"] for c in sc["static_configs"] for t in c["targets"]}
    agents = {f"{s}:9400" for s in compose["services"] if s.startswith("agent")}
    assert agents == targets
