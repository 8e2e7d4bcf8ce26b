"""``rendezvous.backend: etcd``: torch's dynamic rendezvous on etcd's v3 API, with TLS and auth.

Two adapters over one :class:`~trainguard.agent.etcd_client.EtcdClient` (the client and why it is
etcd's JSON gateway on the standard library: see that module):

* :class:`EtcdRendezvousBackend` is a ``RendezvousBackend`` for torch's
  ``DynamicRendezvousHandler``: the pickled rendezvous state is one etcd key, its fencing token is
  the key's ``mod_revision``, and ``set_state`` is one transaction (compare the revision, put, or
  read back the winner's state). So the dynamic rendezvous itself (join, last call, keep-alive
  heartbeats, our planned leave in :mod:`trainguard.agent.rendezvous`) is torch's, unchanged.
* :class:`EtcdStore` is the ``torch.distributed.Store`` the handler hands the agents: torchelastic's
  role infos, assigned ranks, ``MASTER_ADDR``/``MASTER_PORT`` of each round and trainguard's drain
  record (``trainguard/draining``) live there. ``add`` and ``compare_set`` are transactions;
  ``wait``/``get`` block on an etcd watch, bounded by the store timeout.

Keys of job ``J`` live under ``<rendezvous.prefix>/J/`` (default ``/trainguard/J/``): ``state`` and
``store/<key>``, so one etcd role with ``readwrite`` on that prefix is all a job's agents need, and
nothing the job trusts is writable without the job's credentials. The state key carries a lease:
it disappears about two hours after the last agent wrote it (torch's ``etcd-v2`` backend uses the
same TTL), so a finished job's id can be reused; creating a fresh state deletes the store keys of
the previous incarnation in the same transaction, so a reused job id never reads stale ranks or
addresses. Workers still build their own store: the agent runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, so rank 0 publishes a fresh ``MASTER_ADDR``/``MASTER_PORT``
here every round.

Start-up check (:func:`preflight`): authenticate, read the job's prefix and prove write permission
with a transaction whose compare never holds (etcd checks the permissions of both branches and
writes nothing). A failure that waiting cannot fix (TLS, credentials, permissions) ends the agent
at once with :class:`EtcdSetupError`, naming the setting and the fix; an unreachable etcd is
retried until ``join_timeout_s``.

Log events: ``etcd_connected`` (endpoints, tls, user, prefix, seconds), ``etcd_without_tls`` and
``etcd_without_auth`` (warnings), ``etcd_setup_failed`` (key, failure). The password is never logged.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import socket
import ssl
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler as create_dynamic_handler,
)

from trainguard.agent.config import RendezvousConfig
from trainguard.agent.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdFailure,
    EtcdSettings,
    cmp_absent,
    cmp_mod_revision,
    cmp_never,
    cmp_value,
    op_delete,
    op_put,
    op_range,
    prefix_range_end,
    split_host_port,
)
from trainguard.contract.configbase import ConfigError, env_var_for
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.etcd")

BACKEND_NAME = "etcd-v3"
"""What the handler reports as its backend (``get_backend()``, torch's rendezvous logs)."""

STATE_KEY = "state"
STORE_DIR = "store/"
PROBE_KEY = "preflight"


def job_prefix(cfg: RendezvousConfig, job_id: str) -> str:
    """``<prefix>/<job_id>/``: every key of the job is under it (the role needs readwrite on it)."""
    return f"{cfg.prefix.rstrip('/')}/{job_id}/"


def read_password(cfg: RendezvousConfig) -> str:
    """The etcd password from ``password`` or ``password_file`` (its first line). Never logged."""
    if cfg.password_file:
        with open(cfg.password_file, encoding="utf-8") as fh:
            return fh.readline().rstrip("\r\n")
    return cfg.password


def settings_from(cfg: RendezvousConfig) -> EtcdSettings:
    """The client settings for ``cfg`` (reads the password file)."""
    return EtcdSettings(
        endpoints=tuple(e.strip() for e in cfg.endpoint.split(",") if e.strip()),
        ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_file, server_name=cfg.server_name,
        username=cfg.username, password=read_password(cfg) if cfg.username else "",
    )


# ----------------------------------------------------------------------------------- errors
class EtcdSetupError(ConfigError):
    """The agent cannot use etcd as configured: names the setting (YAML key and env var) and the fix.

    A :class:`ConfigError`, so the CLI prints it without a traceback and exits with status 2.
    """

    def __init__(self, key: str, message: str, fix: str, failure: EtcdFailure) -> None:
        ValueError.__init__(self, f"cannot use etcd for the rendezvous: {message}. "
                                  f"Setting: YAML key `{key}` or env var {env_var_for(key)}. Fix: {fix}")
        self.key, self.env_var, self.message, self.fix, self.value, self.source = (
            key, env_var_for(key), message, fix, None, "")
        self.failure = failure


def explain(err: EtcdError, cfg: RendezvousConfig, prefix: str) -> EtcdSetupError:
    """Which setting an etcd failure at start-up points to, and how to fix it (a pure function)."""
    f = err.failure
    where = err.endpoint or cfg.endpoint
    user = cfg.username
    if f is EtcdFailure.SERVER_UNTRUSTED:
        return EtcdSetupError(
            "rendezvous.ca_file", f"the certificate of etcd at {where} is not signed by a CA in {cfg.ca_file} ({err.detail})",
            "set ca_file to the CA bundle that signed etcd's server certificate (the cluster CA, often the same file as "
            "etcd's --trusted-ca-file)", f)
    if f is EtcdFailure.NAME_MISMATCH:
        name = cfg.server_name or split_host_port(where)[0]
        key = "rendezvous.server_name" if cfg.server_name else "rendezvous.endpoint"
        return EtcdSetupError(
            key, f"the certificate of etcd at {where} is not valid for the name {name!r} ({err.detail})",
            "connect by a name or address listed in the certificate's subjectAltName, or set server_name to one of them", f)
    if f is EtcdFailure.CLIENT_CERT_REJECTED:
        if not cfg.cert_file:
            return EtcdSetupError(
                "rendezvous.cert_file", f"etcd at {where} ended the TLS handshake: it requires a client certificate "
                "(--client-cert-auth) and none is configured",
                "set cert_file and key_file to a client certificate signed by the CA in etcd's --trusted-ca-file", f)
        return EtcdSetupError(
            "rendezvous.cert_file", f"etcd at {where} refused the client certificate {cfg.cert_file}: it is not signed by a "
            "CA etcd trusts (--trusted-ca-file)",
            "use a client certificate (and its key_file) issued by the CA in etcd's --trusted-ca-file", f)
    if f is EtcdFailure.CLIENT_CERT_HAS_CN:
        return EtcdSetupError(
            "rendezvous.cert_file", f"etcd at {where} refuses the client certificate {cfg.cert_file} because it has a Common "
            "Name: with --client-cert-auth and authentication both on, etcd's JSON gateway cannot map a CN to a user",
            "issue the client certificate without a CN (a subject such as /O=trainguard, plus a subjectAltName); the "
            "etcd user is set by username/password_file", f)
    if f is EtcdFailure.TLS_MISMATCH:
        if cfg.ca_file:
            return EtcdSetupError(
                "rendezvous.ca_file", f"etcd at {where} does not speak TLS, but ca_file is set ({err.detail})",
                "point endpoint at etcd's https client URL, or remove ca_file/cert_file/key_file for a plain-HTTP etcd", f)
        return EtcdSetupError(
            "rendezvous.ca_file", f"etcd at {where} speaks TLS (https) and ca_file is not set",
            "set ca_file to the CA that signed etcd's certificate (and cert_file/key_file if etcd uses --client-cert-auth)", f)
    if f is EtcdFailure.BAD_CREDENTIALS:
        key = "rendezvous.password_file" if cfg.password_file else "rendezvous.password"
        source = cfg.password_file or env_var_for("rendezvous.password")
        return EtcdSetupError(
            key, f"etcd at {where} rejected user {user!r}: unknown user or wrong password",
            f"put the etcd password of {user!r} in {source} (etcdctl user passwd {user} changes it), or fix username", f)
    if f in (EtcdFailure.AUTH_REQUIRED, EtcdFailure.PERMISSION_DENIED, EtcdFailure.TOKEN_EXPIRED) and not user:
        return EtcdSetupError(
            "rendezvous.username", f"etcd at {where} has authentication enabled and no etcd user is configured ({err.detail})",
            f"set username and password_file (or {env_var_for('rendezvous.password')}) for an etcd user whose role may "
            f"read and write {prefix}", f)
    if f is EtcdFailure.AUTH_DISABLED:
        return EtcdSetupError(
            "rendezvous.username", f"username is {user!r} but authentication is disabled on etcd at {where}, so anyone who "
            "reaches etcd could rewrite this job's rendezvous",
            "enable it on etcd (etcdctl user add root; etcdctl auth enable), or remove username to run deliberately "
            "without authentication", f)
    if f is EtcdFailure.PERMISSION_DENIED:
        return EtcdSetupError(
            "rendezvous.prefix", f"etcd user {user!r} may not read and write the job's keys under {prefix!r} ({err.detail})",
            f"grant one of its roles readwrite on that prefix (etcdctl role grant-permission ROLE --prefix=true "
            f"readwrite {prefix}), or set prefix to the namespace its role covers (keys go to <prefix>/<job_id>/)", f)
    if f is EtcdFailure.UNAVAILABLE:
        return EtcdSetupError(
            "rendezvous.endpoint", f"no etcd member answered at {cfg.endpoint} within join_timeout_s={cfg.join_timeout_s:g} s "
            f"({err.detail})",
            "check that etcd runs and listens on that address (--listen-client-urls) and that no firewall blocks this node", f)
    return EtcdSetupError("rendezvous.endpoint", f"etcd at {where} answered with an error: {err.detail}",
                          "check etcd's log and the rendezvous settings", f)


def speaks_tls(endpoint: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the server at ``endpoint`` completes a TLS handshake (certificates not checked); None
    when nothing answers. Tells "etcd hung up on us" apart: a plain-HTTP etcd drops a TLS hello, an
    https-only etcd drops plain HTTP, and one that wants a client certificate drops us after the
    handshake."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    host, port = split_host_port(endpoint)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    with raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host):
                return True
        except ssl.SSLError as e:
            # A server that wants a client certificate may abort the handshake with an alert: TLS all the same.
            return "alert" in str(e).lower()
        except OSError:
            return False


def _refine(err: EtcdError, settings: EtcdSettings) -> EtcdError:
    """A hang-up during or right after the handshake: is it TLS spoken to a plain server (or the
    reverse) rather than a refused client certificate or a member that is down?"""
    if err.failure in (EtcdFailure.CLIENT_CERT_REJECTED, EtcdFailure.UNAVAILABLE) and err.endpoint:
        tls = speaks_tls(err.endpoint)
        if tls is not None and tls != settings.tls:
            what = "does not speak TLS" if settings.tls else "speaks only TLS"
            return EtcdError(EtcdFailure.TLS_MISMATCH, f"the server {what} ({err.detail})", endpoint=err.endpoint)
    return err


# ----------------------------------------------------------------------------------- the backend
class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the token is its ``mod_revision``. See module docstring."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._key = (prefix + STATE_KEY).encode()
        store = (prefix + STORE_DIR).encode()
        self._store_range = (store, prefix_range_end(store))

    @property
    def name(self) -> str:  # See base class.
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:  # See base class.
        try:
            kv, _ = self._client.get(self._key)
        except EtcdError as e:
            raise RendezvousConnectionError(f"etcd: {e}") from e
        return None if kv is None else (kv.value, str(kv.mod_revision))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:  # See base class.
        revision: int | None = None
        if token is not None:
            try:
                revision = int(token)
            except (TypeError, ValueError):  # not one of ours: the state must have changed under it
                got = self.get_state()
                return None if got is None else (*got, False)

        def build(lease: int) -> tuple[list[Any], list[Any], list[Any]]:
            put = op_put(self._key, state, lease=lease)
            if revision is None:  # a new rendezvous incarnation: drop the previous one's store keys with it
                return [cmp_absent(self._key)], [put, op_delete(self._store_range[0], range_end=self._store_range[1])], \
                    [op_range(self._key)]
            return [cmp_mod_revision(self._key, revision)], [put], [op_range(self._key)]

        try:
            result = self._client.txn_with_lease(build)
        except EtcdError as e:
            raise RendezvousConnectionError(f"etcd: {e}") from e
        if result.succeeded:
            return state, str(result.revision), True
        kvs = result.kvs(0)
        if not kvs:
            return None
        return kvs[0].value, str(kvs[0].mod_revision), False


# ----------------------------------------------------------------------------------- the store
def _as_bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on etcd keys under ``<job prefix>store/``.

    Same semantics as ``TCPStore`` for what torchelastic and the agent use: ``get`` and ``wait``
    block until the keys exist or the store timeout (``set_timeout``, default 300 s) passes, then
    raise ``DistStoreError``; ``add`` is atomic (a compare-and-swap transaction, retried on
    contention); ``compare_set`` with an empty ``expected`` creates the key only if it is missing.
    Thread-safe (the client is). The C++ ``PrefixStore`` calls ``deleteKey``/``getNumKeys`` on a
    Python store; they are aliases of ``delete_key``/``num_keys``.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: datetime.timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = (prefix + STORE_DIR).encode()
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

    def _timeout_s(self, override: datetime.timedelta | None = None) -> float:
        return (override if override is not None else self.timeout).total_seconds()

    def set(self, key: str, value: str | bytes) -> None:  # See base class.
        try:
            self._client.put(self._key(key), _as_bytes(value))
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store set({key!r}): {e}") from e

    def get(self, key: str) -> bytes:  # See base class.
        k = self._key(key)
        try:
            kv, _ = self._client.get(k)
            if kv is None:
                if not self._wait([k], self._timeout_s()):
                    raise dist.DistStoreError(f"etcd store: key {key!r} not set within {self._timeout_s():g} s")
                kv, _ = self._client.get(k)
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store get({key!r}): {e}") from e
        if kv is None:
            raise dist.DistStoreError(f"etcd store: key {key!r} was deleted while being read")
        return kv.value

    def add(self, key: str, value: int) -> int:  # See base class.
        k = self._key(key)
        deadline = time.monotonic() + self._timeout_s()
        try:
            kv, _ = self._client.get(k)
            while True:
                current = int(kv.value) if kv is not None else 0
                cmp = cmp_absent(k) if kv is None else cmp_mod_revision(k, kv.mod_revision)
                new = current + int(value)
                result = self._client.txn([cmp], [op_put(k, str(new).encode())], [op_range(k)], idempotent=False)
                if result.succeeded:
                    return new
                kvs = result.kvs(0)
                kv = kvs[0] if kvs else None
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"etcd store add({key!r}): still contended after {self._timeout_s():g} s")
                time.sleep(random.uniform(0, 0.01))
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store add({key!r}): {e}") from e
        except ValueError as e:
            raise dist.DistStoreError(f"etcd store add({key!r}): the value is not an integer") from e

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:  # See base class.
        k, expected, desired = self._key(key), _as_bytes(expected_value), _as_bytes(desired_value)
        cmp = cmp_absent(k) if not expected else cmp_value(k, expected)
        try:
            result = self._client.txn([cmp], [op_put(k, desired)], [op_range(k)])
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store compare_set({key!r}): {e}") from e
        if result.succeeded:
            return desired
        kvs = result.kvs(0)
        return kvs[0].value if kvs else expected  # TCPStore answers `expected` for a missing key

    def check(self, keys: list[str]) -> bool:  # See base class.
        try:
            return self._present([self._key(k) for k in keys])[0]
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store check: {e}") from e

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # See base class.
        t = self._timeout_s(timeout)
        try:
            ok = self._wait([self._key(k) for k in keys], t)
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store wait: {e}") from e
        if not ok:
            raise dist.DistStoreError(f"etcd store: keys {list(keys)} not set within {t:g} s")

    def delete_key(self, key: str) -> bool:  # See base class.
        try:
            return self._client.delete(self._key(key)) > 0
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store delete_key({key!r}): {e}") from e

    def num_keys(self) -> int:  # See base class.
        try:
            return self._client.count(self._prefix)
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store num_keys: {e}") from e

    deleteKey = delete_key  # noqa: N815 - the names the C++ trampoline looks up
    getNumKeys = num_keys  # noqa: N815

    def _present(self, keys: list[bytes]) -> tuple[bool, int]:
        """(whether every key exists, the store revision of that read), in one transaction."""
        if not keys:
            return True, 0
        result = self._client.txn([], [op_range(k, count_only=True) for k in keys])
        return all(result.count(i) > 0 for i in range(len(keys))), result.revision

    def _wait(self, keys: list[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            present, revision = self._present(keys)
            if present:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._client.wait_for_change(self._prefix, revision, left):
                # Timed out, or the watch could not be held open (a member going away): re-read, and
                # do not spin while etcd is unreachable.
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


# ----------------------------------------------------------------------------------- building it
def preflight(settings: EtcdSettings, prefix: str, deadline: float) -> None:
    """Prove, before joining, that this node can authenticate, read and write the job's keys.

    Raises :class:`EtcdError`: at once for failures waiting cannot fix, and for an unreachable etcd
    once ``deadline`` (``time.monotonic()``) has passed.
    """
    probe = (prefix + PROBE_KEY).encode()
    while True:
        left = deadline - time.monotonic()
        # One round over the members per attempt, within what is left of the deadline.
        client = EtcdClient(dataclasses.replace(settings, retry_s=0.0, timeout_s=max(0.2, min(settings.timeout_s, left))))
        try:
            client.authenticate()
            client.count(prefix.encode())
            client.txn([cmp_never(probe)], [op_put(probe, b"")])
            return
        except EtcdError as e:
            e = _refine(e, settings)
            if not e.failure.retryable or time.monotonic() >= deadline:
                raise e from None
        finally:
            client.close()
        time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))


def create_handler(cfg: RendezvousConfig, params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The dynamic rendezvous handler on etcd v3 for ``params.run_id``; raises :class:`EtcdSetupError`
    when etcd cannot be used as configured (after at most ``join_timeout_s``)."""
    client, prefix = connect(cfg, params.run_id)
    return create_dynamic_handler(EtcdStore(client, prefix), EtcdRendezvousBackend(client, prefix), params)


def connect(cfg: RendezvousConfig, run_id: str) -> tuple[EtcdClient, str]:
    """The checked client and the job's prefix (:func:`preflight`, the security warnings, ``etcd_connected``),
    for either rendezvous protocol; raises :class:`EtcdSetupError` as :func:`create_handler` does."""
    prefix = job_prefix(cfg, run_id)
    settings = settings_from(cfg)
    started = time.monotonic()
    try:
        preflight(settings, prefix, started + cfg.join_timeout_s)
    except EtcdError as e:
        err = explain(e, cfg, prefix)
        log.error("etcd_setup_failed", key=err.key, failure=err.failure.value, error=err.message)
        raise err from None
    if not settings.tls:
        log.warning("etcd_without_tls", endpoint=cfg.endpoint,
                    risk="rendezvous traffic and credentials cross the network in clear text; set rendezvous.ca_file")
    if not settings.username:
        log.warning("etcd_without_auth", endpoint=cfg.endpoint,
                    risk="anyone who reaches etcd can rewrite this job's rendezvous; set rendezvous.username")
    log.info("etcd_connected", endpoints=list(settings.endpoints), tls=settings.tls, client_cert=bool(settings.cert_file),
             user=settings.username or None, prefix=prefix, seconds=round(time.monotonic() - started, 3))
    return EtcdClient(settings), prefix


__all__ = ["BACKEND_NAME", "EtcdRendezvousBackend", "EtcdSetupError", "EtcdStore", "connect", "create_handler", "explain",
           "job_prefix", "preflight", "read_password", "settings_from"]
