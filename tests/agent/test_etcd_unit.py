"""The etcd v3 backend without an etcd: failure classification, the setting each failure names, key
ranges, and the TLS/auth config checks done at load time (tables of cases)."""

from __future__ import annotations

import http.client
import json
import ssl

import pytest

from trainguard.agent.config import RendezvousConfig
from trainguard.agent.configload import load_config, redacted
from trainguard.agent.etcd_client import (
    CN_REFUSED_MARKER,
    EtcdError,
    EtcdFailure,
    failure_of_answer,
    failure_of_exception,
    prefix_range_end,
    split_host_port,
)
from trainguard.agent.etcd_rendezvous import explain, job_prefix, read_password
from trainguard.contract.configbase import ConfigError, env_var_for

F = EtcdFailure

ANSWERS = [
    # (HTTP status, gateway answer, failure)
    (400, {"error": "etcdserver: authentication failed, invalid user ID or password", "code": 3}, F.BAD_CREDENTIALS),
    (400, {"message": "etcdserver: user name is empty", "code": 3}, F.AUTH_REQUIRED),
    (400, {"message": "etcdserver: authentication is not enabled", "code": 9}, F.AUTH_DISABLED),
    (401, {"message": "etcdserver: invalid auth token", "code": 16}, F.TOKEN_EXPIRED),
    (400, {"message": "etcdserver: revision of auth store is old", "code": 3}, F.TOKEN_EXPIRED),
    (403, {"message": "etcdserver: permission denied", "code": 7}, F.PERMISSION_DENIED),
    (404, {"message": "etcdserver: requested lease not found", "code": 5}, F.LEASE_NOT_FOUND),
    (503, {"message": "etcdserver: leader changed", "code": 14}, F.UNAVAILABLE),
    (503, {"message": "etcdserver: no leader", "code": 14}, F.UNAVAILABLE),
    (504, {"message": "etcdserver: request timed out", "code": 4}, F.UNAVAILABLE),
    (429, {"message": "etcdserver: too many requests", "code": 8}, F.UNAVAILABLE),
    (400, f"{CN_REFUSED_MARKER} will be ignored and not used as expected", F.CLIENT_CERT_HAS_CN),
    (400, "Client sent an HTTP request to an HTTPS server.", F.TLS_MISMATCH),
    (400, {"message": "etcdserver: key is not provided", "code": 3}, F.REQUEST),
    (404, "404 page not found", F.REQUEST),
]


@pytest.mark.parametrize("status,body,failure", ANSWERS, ids=[f.value + str(i) for i, (_, _, f) in enumerate(ANSWERS)])
def test_failure_of_answer(status, body, failure):
    assert failure_of_answer(status, body) is failure


def _verify_error(message: str) -> ssl.SSLCertVerificationError:
    e = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: {message}")
    e.verify_message = message
    return e


EXCEPTIONS = [
    (_verify_error("unable to get local issuer certificate"), F.SERVER_UNTRUSTED),
    (_verify_error("self-signed certificate in certificate chain"), F.SERVER_UNTRUSTED),
    (_verify_error("Hostname mismatch, certificate is not valid for 'etcd.example.com'."), F.NAME_MISMATCH),
    (_verify_error("IP address mismatch, certificate is not valid for '10.0.0.9'."), F.NAME_MISMATCH),
    (ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"), F.TLS_MISMATCH),
    (ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required"), F.CLIENT_CERT_REJECTED),
    (ssl.SSLError(1, "[SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate"), F.CLIENT_CERT_REJECTED),
    (ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:2427)"), F.CLIENT_CERT_REJECTED),
    (ConnectionRefusedError(111, "Connection refused"), F.UNAVAILABLE),
    (TimeoutError("timed out"), F.UNAVAILABLE),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), F.UNAVAILABLE),
    (http.client.BadStatusLine("\x15\x03\x01\x00\x02\x02"), F.TLS_MISMATCH),
]


@pytest.mark.parametrize("exc,failure", EXCEPTIONS, ids=[f"{type(e).__name__}-{f.value}" for e, f in EXCEPTIONS])
def test_failure_of_exception(exc, failure):
    assert failure_of_exception(exc) is failure


def test_only_unavailable_is_retried():
    assert [f for f in EtcdFailure if f.retryable] == [EtcdFailure.UNAVAILABLE]


@pytest.mark.parametrize("prefix,end", [(b"/trainguard/job/", b"/trainguard/job0"), (b"a", b"b"), (b"a\xff", b"b"),
                                        (b"\xff\xff", b"\0")])
def test_prefix_range_end(prefix, end):
    assert prefix_range_end(prefix) == end


@pytest.mark.parametrize("endpoint,expected", [("10.0.0.5:2379", ("10.0.0.5", 2379)), ("[::1]:2379", ("::1", 2379)),
                                               ("etcd-a.internal:443", ("etcd-a.internal", 443))])
def test_split_host_port(endpoint, expected):
    assert split_host_port(endpoint) == expected


# ------------------------------------------------------------------------------- which setting is named
def _cfg(tmp_path, **kw) -> RendezvousConfig:
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    base = {"backend": "etcd", "endpoint": "10.0.0.5:2379", "username": "tg-job", "password_file": str(pw)}
    base.update(kw)
    return RendezvousConfig(**base)


EXPLAIN = [
    # (failure, config overrides, key named, fragment of the fix)
    (F.SERVER_UNTRUSTED, {}, "rendezvous.ca_file", "CA bundle that signed etcd's server certificate"),
    (F.NAME_MISMATCH, {}, "rendezvous.endpoint", "subjectAltName"),
    (F.NAME_MISMATCH, {"server_name": "etcd.internal", "ca_file": "{ca}"}, "rendezvous.server_name", "subjectAltName"),
    (F.CLIENT_CERT_REJECTED, {}, "rendezvous.cert_file", "client certificate signed by the CA"),
    (F.CLIENT_CERT_HAS_CN, {}, "rendezvous.cert_file", "without a CN"),
    (F.TLS_MISMATCH, {}, "rendezvous.ca_file", "set ca_file"),
    (F.BAD_CREDENTIALS, {}, "rendezvous.password_file", "etcdctl user passwd tg-job"),
    (F.BAD_CREDENTIALS, {"password_file": "", "password": "hunter2"}, "rendezvous.password", "TRAINGUARD_RENDEZVOUS_PASSWORD"),
    (F.AUTH_REQUIRED, {"username": "", "password_file": ""}, "rendezvous.username", "set username and password_file"),
    (F.PERMISSION_DENIED, {"username": "", "password_file": ""}, "rendezvous.username", "set username"),
    (F.AUTH_DISABLED, {}, "rendezvous.username", "etcdctl auth enable"),
    (F.PERMISSION_DENIED, {}, "rendezvous.prefix", "grant-permission ROLE --prefix=true readwrite /trainguard/job/"),
    (F.UNAVAILABLE, {}, "rendezvous.endpoint", "check that etcd runs"),
    (F.REQUEST, {}, "rendezvous.endpoint", "etcd's log"),
]


@pytest.mark.parametrize("failure,kw,key,fix", EXPLAIN, ids=[f"{f.value}->{k}" for f, _, k, _ in EXPLAIN])
def test_explain_names_the_setting_its_env_var_and_the_fix(tmp_path, files, failure, kw, key, fix):
    cfg = _cfg(tmp_path, **{k: v.format(**files) for k, v in kw.items()})
    err = explain(EtcdError(failure, "detail", endpoint="10.0.0.5:2379"), cfg, job_prefix(cfg, "job"))
    assert isinstance(err, ConfigError)  # the CLI prints it without a traceback, exit status 2
    assert err.key == key and err.failure is failure
    text = str(err)
    assert f"`{key}`" in text and env_var_for(key) in text and fix in text
    assert "hunter2" not in text


def test_job_prefix_and_password_file(tmp_path):
    cfg = _cfg(tmp_path, prefix="/teams/ml/")
    assert job_prefix(cfg, "run7") == "/teams/ml/run7/"
    assert read_password(cfg) == "hunter2"  # first line, newline stripped


# ------------------------------------------------------------------------------- config checks at load time
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A real CA, client cert and key (a throwaway PKI), a password file and a file that is not PEM."""
    from tests.fixtures.etcd import make_pki

    tmp_path = tmp_path_factory.mktemp("etcd-files")
    pki = make_pki(tmp_path / "pki")
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    return {"ca": pki.ca_file, "cert": pki.client_cert, "key": pki.client_key, "other_key": pki.server_key,
            "pw": str(pw), "empty": str(empty), "junk": str(junk), "missing": str(tmp_path / "nope.pem")}


BAD_SECURITY = [
    # (rendezvous settings ({name} = a file from the fixture), key named, fragment)
    ({"backend": "c10d", "ca_file": "{ca}"}, "rendezvous.backend", "apply to backend 'etcd' only"),
    ({"backend": "etcd-v2", "username": "u", "password_file": "{pw}"}, "rendezvous.backend", "apply to backend 'etcd' only"),
    ({"ca_file": "{missing}"}, "rendezvous.ca_file", "does not exist"),
    ({"ca_file": "{junk}"}, "rendezvous.ca_file", "not a PEM CA bundle"),
    ({"ca_file": "{ca}", "cert_file": "{cert}"}, "rendezvous.key_file", "go together"),
    ({"ca_file": "{ca}", "key_file": "{key}"}, "rendezvous.cert_file", "go together"),
    ({"cert_file": "{cert}", "key_file": "{key}"}, "rendezvous.ca_file", "only sent over TLS"),
    ({"ca_file": "{ca}", "cert_file": "{cert}", "key_file": "{other_key}"}, "rendezvous.key_file", "is not the private key"),
    ({"ca_file": "{ca}", "cert_file": "{junk}", "key_file": "{key}"}, "rendezvous.cert_file", "not a PEM certificate"),
    ({"ca_file": "{ca}", "cert_file": "{cert}", "key_file": "{junk}"}, "rendezvous.key_file", "unencrypted PEM private key"),
    ({"server_name": "etcd.internal"}, "rendezvous.server_name", "only used with TLS"),
    ({"username": "tg-job"}, "rendezvous.username", "has no password configured"),
    ({"password_file": "{pw}"}, "rendezvous.username", "no username"),
    ({"username": "tg-job", "password_file": "{missing}"}, "rendezvous.password_file", "does not exist"),
    ({"username": "tg-job", "password_file": "{empty}"}, "rendezvous.password_file", "empty first line"),
    ({"prefix": "trainguard"}, "rendezvous.prefix", "absolute key path"),
    ({"endpoint": "10.0.0.5:2379,10.0.0.6"}, "rendezvous.endpoint", "comma-separated list"),
]


@pytest.mark.parametrize("settings,key,fragment", BAD_SECURITY, ids=[f"{k}:{f[:18]}" for _, k, f in BAD_SECURITY])
def test_bad_tls_or_auth_settings_name_key_env_and_fix(tmp_path, files, settings, key, fragment):
    body = {"backend": "etcd", "endpoint": "127.0.0.1:2379", **{k: v.format(**files) for k, v in settings.items()}}
    path = tmp_path / "agent.yaml"
    path.write_text(json.dumps({"rendezvous": body}))  # JSON is YAML
    with pytest.raises(ConfigError) as ei:
        load_config(str(path), {})
    msg = str(ei.value)
    assert ei.value.key == key, msg
    assert key in msg and env_var_for(key) in msg and fragment in msg, msg
    assert "s3cret-pw" not in msg


def test_password_both_ways_is_an_error_that_never_shows_the_password(tmp_path, files):
    path = tmp_path / "agent.yaml"
    path.write_text(json.dumps({"rendezvous": {"backend": "etcd", "username": "u", "password_file": files["pw"]}}))
    with pytest.raises(ConfigError) as ei:
        load_config(str(path), {"TRAINGUARD_RENDEZVOUS_PASSWORD": "env-pw-123"})
    assert ei.value.key == "rendezvous.password_file" and "env-pw-123" not in str(ei.value)


def test_valid_secure_config_loads_and_the_password_is_never_shown(tmp_path, files):
    env = {"TRAINGUARD_RENDEZVOUS_BACKEND": "etcd", "TRAINGUARD_RENDEZVOUS_ENDPOINT": "10.0.0.5:2379,10.0.0.6:2379",
           "TRAINGUARD_RENDEZVOUS_CA_FILE": files["ca"], "TRAINGUARD_RENDEZVOUS_CERT_FILE": files["cert"],
           "TRAINGUARD_RENDEZVOUS_KEY_FILE": files["key"], "TRAINGUARD_RENDEZVOUS_USERNAME": "tg-job",
           "TRAINGUARD_RENDEZVOUS_PASSWORD": "env-pw-123"}
    cfg = load_config(None, env)
    r = cfg.rendezvous
    assert (r.backend, r.username, r.password, r.prefix) == ("etcd", "tg-job", "env-pw-123", "/trainguard")
    assert "env-pw-123" not in repr(cfg)
    shown = json.dumps(redacted(cfg))
    assert "env-pw-123" not in shown and files["ca"] in shown and "tg-job" in shown
