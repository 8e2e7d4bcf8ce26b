"""``rendezvous.backend: etcd`` against a real etcd v3 with TLS, client certificates and RBAC (no
workers): the backend's compare-and-swap, the store's TCPStore semantics, a two-node rendezvous, that
nobody without the job's credentials can write its keys, and that every misconfiguration ends the
agent with an error naming the setting (in-process, and through the CLI with no traceback)."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
import structlog
import torch.distributed as dist

from tests.fixtures.etcd import SECURE_JOB, b64, gateway, secure_etcd  # noqa: F401
from tests.harness import EXAMPLE, REPO, free_port
from trainguard.agent.configload import load_config
from trainguard.agent.etcd_client import EtcdClient, EtcdFailure
from trainguard.agent.etcd_rendezvous import (
    EtcdRendezvousBackend,
    EtcdSetupError,
    EtcdStore,
    settings_from,
)
from trainguard.agent.rendezvous import build_handler


def rdzv_config(etcd, **override):
    """The agent's ``rendezvous`` section, loaded and validated like the agent does."""
    return load_config(None, {}, {**etcd.rendezvous_settings(**override), "rendezvous.join_timeout_s": "20"}).rendezvous


@pytest.fixture
def client(secure_etcd):  # noqa: F811
    """A client of the job user, on an empty job prefix."""
    c = EtcdClient(settings_from(rdzv_config(secure_etcd)))
    p = secure_etcd.job_prefix.encode()
    c.delete(p, range_end=p[:-1] + b"0")
    yield c
    c.close()


def raw_value(etcd, key):
    """``(value, lease id)`` of a key, read as root over a raw gateway call."""
    status, answer = gateway(etcd.url, "kv/range", {"key": b64(key)}, etcd.pki.client_context(), etcd.root_token())
    assert status == 200, answer
    kvs = answer.get("kvs", [])
    return (base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else (None, 0)


# ----------------------------------------------------------------------------------- semantics
def test_backend_compare_and_swap_on_the_key_revision(client, secure_etcd):  # noqa: F811
    b = EtcdRendezvousBackend(client, secure_etcd.job_prefix)
    assert b.name == "etcd-v3" and b.get_state() is None
    state, t1, ok = b.set_state(b"s1")
    assert (state, ok) == (b"s1", True)
    assert b.set_state(b"other") == (b"s1", t1, False)  # token None: set only if there is no state yet
    state, t2, ok = b.set_state(b"s2", t1)
    assert (state, ok) == (b"s2", True) and int(t2) > int(t1)
    assert b.set_state(b"s3", t1) == (b"s2", t2, False)  # stale token: the current state comes back
    assert b.set_state(b"s3", "not-a-revision") == (b"s2", t2, False)
    assert b.get_state() == (b"s2", t2)
    value, lease = raw_value(secure_etcd, secure_etcd.job_prefix + "state")
    assert value == b"s2" and lease != 0  # the state expires ~2 h after the last write (torch etcd-v2's TTL)


def test_a_fresh_rendezvous_starts_with_an_empty_store(client, secure_etcd):  # noqa: F811
    b, store = EtcdRendezvousBackend(client, secure_etcd.job_prefix), EtcdStore(client, secure_etcd.job_prefix)
    store.set("torch.rendezvous.job.0/MASTER_ADDR", b"stale-host")
    assert store.check(["torch.rendezvous.job.0/MASTER_ADDR"])
    b.set_state(b"new incarnation")
    assert not store.check(["torch.rendezvous.job.0/MASTER_ADDR"])  # a reused job id never reads old ranks/addresses


def test_store_has_tcpstore_semantics(client, secure_etcd):  # noqa: F811
    s = EtcdStore(client, secure_etcd.job_prefix, timeout=datetime.timedelta(seconds=10))
    p = dist.PrefixStore("torch.rendezvous.job.3", s)  # how torch hands it to the agents: C++ calls into Python
    p.set("a", b"1")
    p.set("b", "text")
    assert (p.get("a"), p.get("b")) == (b"1", b"text")
    assert p.check(["a", "b"]) and not p.check(["a", "missing"])
    assert p.multi_get(["a", "b"]) == [b"1", b"text"]

    threading.Timer(0.3, lambda: p.set("late", b"here")).start()
    t0 = time.monotonic()
    assert p.get("late") == b"here"  # blocks on an etcd watch until another node writes it
    assert time.monotonic() - t0 < 5

    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="not set within"):
        p.wait(["never"], datetime.timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 5  # every wait is bounded

    assert p.compare_set("cs", b"", b"first") == b"first"  # missing + expected "" -> created
    assert p.compare_set("cs", b"wrong", b"x") == b"first"  # mismatch -> current value
    assert p.compare_set("cs", b"first", b"second") == b"second"
    assert p.compare_set("cs-missing", b"expected", b"x") == b"expected"  # TCPStore's answer for a missing key
    assert not p.check(["cs-missing"])

    assert p.delete_key("a") and not p.delete_key("a")
    assert p.num_keys() == s.num_keys() == 3  # b, late, cs: the keys of the job's store folder

    results: list[int] = []

    def adder() -> None:
        for _ in range(20):
            results.append(p.add("counter", 1))

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(1, 81))  # atomic under contention: no increment lost or repeated
    assert p.get("counter") == b"80"


def test_two_nodes_rendezvous_and_hand_their_workers_a_fresh_master_address(secure_etcd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # what the agent sets for itself
    cfg = dataclasses.replace(rdzv_config(secure_etcd), min_nodes=2, max_nodes=2, last_call_timeout_s=1)
    p = secure_etcd.job_prefix.encode()
    EtcdClient(settings_from(cfg)).delete(p, range_end=p[:-1] + b"0")
    handlers = [build_handler(cfg, SECURE_JOB) for _ in range(2)]
    infos: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: infos.__setitem__(i, handlers[i].next_rendezvous())) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert handlers[0].get_backend() == "etcd-v3"
        ranks = sorted(info.rank for info in infos.values())
        assert ranks == [0, 1] and all(info.world_size == 2 for info in infos.values())
        addrs = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos.values()}
        assert len(addrs) == 1  # rank 0 published MASTER_ADDR/PORT in etcd, rank 1 read it
        infos[0].store.set("trainguard/draining", b"1")
        assert infos[1].store.check(["trainguard/draining"])  # the agents' store is shared, round-scoped
        prefix = secure_etcd.job_prefix + f"store/torch.rendezvous.{SECURE_JOB}."
        status, answer = gateway(secure_etcd.url, "kv/range", {"key": b64(prefix), "range_end": b64(prefix[:-1] + "/"),
                                                               "keys_only": True}, secure_etcd.pki.client_context(),
                                 secure_etcd.root_token())
        keys = [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]
        assert [k for k in keys if k.endswith("/trainguard/draining")], keys  # in etcd, under the job's prefix
    finally:
        handlers[0].shutdown()
        for h in handlers:
            h._stop_heartbeats()


def test_client_fails_over_to_a_live_member_and_renews_an_invalid_token(secure_etcd):  # noqa: F811
    dead = f"127.0.0.1:{free_port()}"
    settings = dataclasses.replace(settings_from(rdzv_config(secure_etcd)), endpoints=(dead, secure_etcd.endpoint))
    c = EtcdClient(settings)
    try:
        key = (secure_etcd.job_prefix + "failover").encode()
        c.put(key, b"1")  # the first member refuses: the second one answers
        assert c.get(key)[0].value == b"1"
        c._token = "not-a-token"  # as after a member restart or --auth-token-ttl: re-authenticate once
        assert c.get(key)[0].value == b"1"
        assert c._token != "not-a-token"
    finally:
        c.close()


# ----------------------------------------------------------------------------------- nobody else writes
def test_without_the_jobs_credentials_nobody_can_write_its_keys(client, secure_etcd):  # noqa: F811
    key = secure_etcd.job_prefix + "state"
    backend = EtcdRendezvousBackend(client, secure_etcd.job_prefix)
    backend.set_state(b"the job's state")
    put = {"key": b64(key), "value": b64("forged")}
    ctx = secure_etcd.pki.client_context()

    # A valid client certificate but no etcd user: refused.
    status, answer = gateway(secure_etcd.url, "kv/put", put, ctx)
    assert status in (400, 403) and ("user name is empty" in answer["message"] or "permission denied" in answer["message"]), answer
    # Another job's user (its role covers /trainguard/other/ only): refused, for puts and transactions.
    pw = open(secure_etcd.outsider_password_file).read().strip()
    status, answer = gateway(secure_etcd.url, "auth/authenticate", {"name": "outsider", "password": pw}, ctx)
    outsider = answer["token"]
    status, answer = gateway(secure_etcd.url, "kv/put", put, ctx, outsider)
    assert status == 403 and "permission denied" in answer["message"], answer
    status, answer = gateway(secure_etcd.url, "kv/txn", {"success": [{"request_put": put}]}, ctx, outsider)
    assert status == 403, answer
    # The job's own user with a wrong password gets no token.
    status, answer = gateway(secure_etcd.url, "auth/authenticate", {"name": "tg-job", "password": "guess"}, ctx)
    assert status == 400 and "token" not in answer
    # No client certificate, or plain HTTP: not even a TLS session.
    import ssl

    bare = ssl.create_default_context(cafile=secure_etcd.pki.ca_file)
    for url, c in ((secure_etcd.url, bare), (secure_etcd.url.replace("https://", "http://"), None)):
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            gateway(url, "kv/put", put, c)

    assert raw_value(secure_etcd, key)[0] == b"the job's state"


# ----------------------------------------------------------------------------------- misconfiguration
def _wrong_password(etcd):
    path = etcd.folder / "wrong.password"
    path.write_text("not-the-password\n")
    return str(path)


SETUP_ERRORS = [
    # (id, overrides as f(etcd) -> dict, key named, failure)
    ("wrong CA", lambda e: {"ca_file": e.pki.rogue_ca_file}, "rendezvous.ca_file", EtcdFailure.SERVER_UNTRUSTED),
    ("wrong password", lambda e: {"password_file": _wrong_password(e)}, "rendezvous.password_file", EtcdFailure.BAD_CREDENTIALS),
    ("missing client cert", lambda e: {"cert_file": "", "key_file": ""}, "rendezvous.cert_file", EtcdFailure.CLIENT_CERT_REJECTED),
    ("user without rights on the prefix", lambda e: {"username": "outsider", "password_file": e.outsider_password_file},
     "rendezvous.prefix", EtcdFailure.PERMISSION_DENIED),
    ("client cert of another CA", lambda e: {"cert_file": e.pki.rogue_client_cert, "key_file": e.pki.rogue_client_key},
     "rendezvous.cert_file", EtcdFailure.CLIENT_CERT_REJECTED),
    ("client cert with a CN", lambda e: {"cert_file": e.pki.client_cn_cert, "key_file": e.pki.client_cn_key},
     "rendezvous.cert_file", EtcdFailure.CLIENT_CERT_HAS_CN),
    ("no user", lambda e: {"username": "", "password_file": ""}, "rendezvous.username", EtcdFailure.PERMISSION_DENIED),
    ("wrong server name", lambda e: {"server_name": "etcd.example.com"}, "rendezvous.server_name", EtcdFailure.NAME_MISMATCH),
    ("plain HTTP to TLS", lambda e: {"ca_file": "", "cert_file": "", "key_file": ""}, "rendezvous.ca_file", EtcdFailure.TLS_MISMATCH),
]


@pytest.mark.parametrize("override,key,failure", [c[1:] for c in SETUP_ERRORS], ids=[c[0] for c in SETUP_ERRORS])
def test_misconfiguration_fails_at_once_naming_the_setting(secure_etcd, override, key, failure):  # noqa: F811
    cfg = rdzv_config(secure_etcd, **override(secure_etcd))
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(EtcdSetupError) as ei:
            build_handler(cfg, SECURE_JOB)
    assert time.monotonic() - t0 < 10  # permanent failures are not retried until join_timeout_s (20 s here)
    assert ei.value.key == key and ei.value.failure is failure, str(ei.value)
    assert [e for e in logs if e["event"] == "etcd_setup_failed" and e["key"] == key]
    assert "not-the-password" not in str(ei.value) + repr(logs)


def test_unreachable_etcd_fails_after_join_timeout_naming_the_endpoint(secure_etcd):  # noqa: F811
    cfg = dataclasses.replace(rdzv_config(secure_etcd, endpoint=f"127.0.0.1:{free_port()}"), join_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(EtcdSetupError) as ei:
        build_handler(cfg, SECURE_JOB)
    elapsed = time.monotonic() - t0
    assert ei.value.key == "rendezvous.endpoint" and "join_timeout_s=1.5" in str(ei.value)
    assert 1.4 <= elapsed < 6, elapsed


def test_plain_etcd_with_tls_or_user_configured(secure_etcd, etcd_server):  # noqa: F811 (etcd_server: service conftest)
    """Against a plain-HTTP etcd without auth: TLS settings point at ca_file, a username at the missing auth."""
    cfg = rdzv_config(secure_etcd, endpoint=etcd_server.endpoint)
    with pytest.raises(EtcdSetupError) as ei:
        build_handler(cfg, SECURE_JOB)
    assert ei.value.key == "rendezvous.ca_file" and ei.value.failure is EtcdFailure.TLS_MISMATCH
    cfg = rdzv_config(secure_etcd, endpoint=etcd_server.endpoint, ca_file="", cert_file="", key_file="")
    with pytest.raises(EtcdSetupError) as ei:
        build_handler(cfg, SECURE_JOB)
    assert ei.value.key == "rendezvous.username" and ei.value.failure is EtcdFailure.AUTH_DISABLED
    cfg = rdzv_config(secure_etcd, endpoint=etcd_server.endpoint, ca_file="", cert_file="", key_file="", username="",
                      password_file="")
    with structlog.testing.capture_logs() as logs:
        handler = build_handler(cfg, SECURE_JOB)  # works, deliberately insecure, and says so
    assert {"etcd_without_tls", "etcd_without_auth", "etcd_connected"} <= {e["event"] for e in logs}
    assert handler.get_backend() == "etcd-v3"


CLI_CASES = [c for c in SETUP_ERRORS if c[0] in {"wrong CA", "wrong password", "missing client cert",
                                                 "user without rights on the prefix"}]


@pytest.mark.slow
def test_agent_exits_with_a_clear_error_and_no_traceback(secure_etcd, tmp_path):  # noqa: F811
    """The acceptance cases through ``trainguard run``: exit 2, the setting named, no traceback, no
    hang (all four agents run at once, then one whose etcd is unreachable with join_timeout_s=3)."""
    cases = [(c[0], secure_etcd.set_flags(**c[1](secure_etcd)), c[2], 30) for c in CLI_CASES]
    cases.append(("unreachable", secure_etcd.set_flags(endpoint=f"127.0.0.1:{free_port()}"), "rendezvous.endpoint", 3))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    procs = []
    for name, flags, key, join_timeout in cases:
        cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", "1", "--rdzv-id", SECURE_JOB,
               "--state-dir", str(tmp_path / f"state-{len(procs)}"), "--log-dir", str(tmp_path / "logs"),
               "--set", "agent.log_format=json", "--set", "metrics.port=0", "--set", "preemption.sources=signal",
               *flags, "--set", f"rendezvous.join_timeout_s={join_timeout}", EXAMPLE]
        procs.append((name, key, join_timeout, time.monotonic(),
                      subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)))
    try:
        for name, key, join_timeout, started, proc in procs:
            out = proc.communicate(timeout=join_timeout + 60)[0].decode(errors="replace")
            elapsed = time.monotonic() - started
            assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{out}"
            assert "Traceback" not in out, f"{name}:\n{out}"
            assert f"Setting: YAML key `{key}` or env var" in out, f"{name}:\n{out}"
            assert "not-the-password" not in out
            assert elapsed < join_timeout + 45, f"{name}: took {elapsed:.0f} s"  # start-up (torch import) + the deadline
    finally:
        for *_, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
