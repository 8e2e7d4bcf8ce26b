"""Build the agent image on a locally made base and run the CLI in it (marker ``docker``).

No registry is reachable, so the base is made here: ``debootstrap`` a minimal Debian bookworm
(python3.11), ``docker import`` it, then add a venv with the torch CPU wheel. The Docker engine is
the one at ``$TG_DOCKER_HOST`` if that answers, else a ``dockerd`` started by this test
with its own data root, exec root and socket in /tmp (needs root). Anything missing skips with
the reason.

Knobs (environment): ``TG_DOCKER_DATA_ROOT`` keeps the engine's data between runs (so the
base is built once); ``TG_TORCH_WHEEL`` is the torch wheel for the base (default: the
first ``/opt/wheels/torch-2.13.0*-cp311-*.whl``); ``TG_DEBIAN_MIRROR`` the debootstrap
mirror. The build's pip reaches PyPI through ``--network host`` and trusts the host's CA bundle,
which is copied into the base.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEBIAN_IMAGE = "trainguard-test-debian:bookworm"
BASE_IMAGE = "trainguard-test-base:torch-2.13.0"
IMAGE = "trainguard:test"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]


@dataclass(frozen=True, slots=True)
class Engine:
    """A reachable Docker engine."""

    host: str  # DOCKER_HOST value

    def run(self, *args: str, timeout: float = 600, check: bool = True,
            input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        docker = shutil.which("docker")
        assert docker is not None
        env = {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}
        r = subprocess.run([docker, *args], capture_output=True, timeout=timeout, env=env, input=input)
        if check and r.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args[:3])} ... failed rc={r.returncode}\n"
                f"{r.stdout.decode(errors='replace')[-6000:]}\n{r.stderr.decode(errors='replace')[-6000:]}"
            )
        return r

    def has_image(self, ref: str) -> bool:
        return self.run("image", "inspect", ref, check=False, timeout=60).returncode == 0


def _answers(host: str) -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    r = subprocess.run([docker, "info"], capture_output=True, timeout=30, env={**os.environ, "DOCKER_HOST": host})
    return r.returncode == 0


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """A Docker engine: ``$TG_DOCKER_HOST`` or a private ``dockerd``; skip if neither."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client (apt-get install docker.io)")
    given = os.environ.get("TG_DOCKER_HOST")
    if given and _answers(given):
        yield Engine(given)
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip("no dockerd (apt-get install docker.io) and no TG_DOCKER_HOST")
    if os.geteuid() != 0:
        pytest.skip("starting dockerd needs root")
    run_dir = Path(tempfile.mkdtemp(prefix="tgd-", dir="/tmp"))  # short: AF_UNIX paths <= 107 bytes
    keep = os.environ.get("TG_DOCKER_DATA_ROOT")
    data_root = Path(keep) if keep else run_dir / "root"
    data_root.mkdir(parents=True, exist_ok=True)
    host = f"unix://{run_dir}/docker.sock"
    log_path = run_dir / "dockerd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [dockerd, "--data-root", str(data_root), "--exec-root", str(run_dir / "exec"),
             "--pidfile", str(run_dir / "docker.pid"), "-H", host,
             "--bridge=none", "--iptables=false", "--ip-masq=false"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not _answers(host):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.skip(f"dockerd did not start (rc={proc.poll()}):\n{tail}")
            time.sleep(1)
        yield Engine(host)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)


def _torch_wheel() -> Path | None:
    given = os.environ.get("TG_TORCH_WHEEL")
    if given:
        return Path(given)
    found = sorted(glob.glob("/opt/wheels/torch-2.13.0*-cp311-*.whl"))
    return Path(found[0]) if found else None


def _build_base(engine: Engine, work: Path) -> None:
    """debootstrap -> docker import -> venv with torch: ``BASE_IMAGE``."""
    if engine.has_image(BASE_IMAGE):
        return
    wheel = _torch_wheel()
    if wheel is None or not wheel.exists():
        pytest.skip("no torch 2.13.0 cp311 wheel for the test base (set TG_TORCH_WHEEL)")
    if not engine.has_image(DEBIAN_IMAGE):
        debootstrap = shutil.which("debootstrap")
        if debootstrap is None:
            pytest.skip("debootstrap not installed (apt-get install debootstrap)")
        rootfs = work / "rootfs"
        mirror = os.environ.get("TG_DEBIAN_MIRROR", "http://deb.debian.org/debian")
        r = subprocess.run(
            [debootstrap, "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", str(rootfs), mirror],
            capture_output=True, timeout=1200,
        )
        if r.returncode != 0:
            pytest.skip(f"debootstrap failed (rc={r.returncode}): {r.stderr.decode(errors='replace')[-2000:]}")
        # The build's pip must trust whatever the host trusts (e.g. a TLS-inspecting proxy).
        shutil.copy(HOST_CA, rootfs / "etc/ssl/certs/ca-certificates.crt")
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        docker = shutil.which("docker")
        assert docker is not None
        imp = subprocess.run(
            [docker, "import",
             "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--change", f"ENV PIP_CERT={HOST_CA} SSL_CERT_FILE={HOST_CA} REQUESTS_CA_BUNDLE={HOST_CA}",
             "--change", "ENV LANG=C.UTF-8",
             "-", DEBIAN_IMAGE],
            stdin=tar.stdout, capture_output=True, timeout=600, env={**os.environ, "DOCKER_HOST": engine.host},
        )
        tar.wait(timeout=60)
        assert imp.returncode == 0, imp.stderr.decode(errors="replace")
        shutil.rmtree(rootfs, ignore_errors=True)
    ctx = work / "base-ctx"
    ctx.mkdir()
    shutil.copy(wheel, ctx / wheel.name)
    (ctx / "Dockerfile").write_text(
        f"FROM {DEBIAN_IMAGE}\n"
        f"COPY {wheel.name} /tmp/\n"
        f"RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir /tmp/{wheel.name} "
        f"&& rm /tmp/{wheel.name}\n"
        "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    )
    engine.run("build", "--network", "host", "-t", BASE_IMAGE, str(ctx), timeout=1800)


def _stage_context(dest: Path) -> None:
    """The build context: what git would ship (tracked + untracked, not ignored), no venv or caches."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def test_image_builds_and_cli_runs(engine: Engine, tmp_path: Path) -> None:
    _build_base(engine, tmp_path)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    _stage_context(ctx)
    engine.run(
        "build", "--network", "host", "-f", "docker/Dockerfile",
        "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, str(ctx), timeout=1800,
    )

    version = engine.run("run", "--rm", "--network", "none", IMAGE, "--version", timeout=120)
    from importlib.metadata import version as installed

    assert version.stdout.decode().strip() == f"trainguard {installed('trainguard')}", version

    check = engine.run(
        "run", "--rm", "--network", "none", IMAGE, "config", "check", "/etc/trainguard/agent.yaml", timeout=120,
    )
    assert check.returncode == 0 and check.stdout.decode().strip() == "/etc/trainguard/agent.yaml: OK", check

    user = engine.run("run", "--rm", "--network", "none", "--entrypoint", "id", IMAGE, "-u", timeout=60)
    assert user.stdout.strip() == b"10001"
