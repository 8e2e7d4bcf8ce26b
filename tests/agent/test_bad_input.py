"""Issue 15's table of bad inputs: each ends with ``trainguard: <what> (<YAML key> / <env var>): <fix>``
on one stderr line and exit code 2 — never a traceback, never a value of a secret setting.

Rows run ``trainguard.agent.cli.main`` in-process (an uncaught exception fails the test, the same
guarantee as "no Traceback"); :func:`test_real_process_prints_no_traceback` runs a few of them as
real processes and greps their stderr. ``run`` rows must fail in the pre-flight checks: starting an
agent is an error of the test (``run_agent`` is replaced by a tripwire).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
import structlog

import trainguard.agent.daemon  # noqa: F401 - imported before the leak guard: the supervisor sets a torch env var on import
from trainguard.agent import cli, control
from trainguard.contract import protocol as proto
from trainguard.contract.configbase import env_var_for

LINE = re.compile(r"^trainguard: (?P<what>.+) \((?P<where>[^()]+)\): (?P<fix>.+)$")
SECRET = "sk-CANARY-bad-input"


@pytest.fixture(autouse=True)
def restore_logging():
    """`run` rows configure logging onto pytest's captured stderr, closed after the test: put it back."""
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


@pytest.fixture
def files(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"agent:\n  job_id: caf\xe9\n")

    def yaml(name: str, text: str) -> str:
        p = tmp_path / name
        p.write_text(text)
        return str(p)

    return {"tmp": str(tmp_path), "script": str(script), "latin1": str(latin1), "yaml": yaml}


def run_args(f, *extra: str) -> list[str]:
    return ["run", "--standalone", "--state-dir", os.path.join(f["tmp"], "state"), "--log-dir",
            os.path.join(f["tmp"], "logs"), "--set", "preemption.sources=none", "--set", "metrics.enabled=false",
            *extra, f["script"]]


def _silent_server(path: str) -> tuple[socket.socket, threading.Event]:
    """A Unix socket that accepts and never answers (a wedged agent)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    return srv, threading.Event()


# (id, argv builder, env, expected key (None: a flag, no env var), fragment of <what>)
ROWS = [
    ("config-check-directory", lambda f: ["config", "check", f["tmp"]], {}, ("--config", "TRAINGUARD_CONFIG"), "is a directory"),
    ("config-check-not-utf8", lambda f: ["config", "check", f["latin1"]], {}, ("--config", "TRAINGUARD_CONFIG"), "not UTF-8"),
    ("config-check-missing", lambda f: ["config", "check", f["tmp"] + "/nope.yaml"], {}, ("--config", "TRAINGUARD_CONFIG"), "not found"),
    ("config-check-no-file", lambda f: ["config", "check"], {}, ("--config", "TRAINGUARD_CONFIG"), "no config file"),
    ("config-check-two-files", lambda f: ["config", "check", f["latin1"], "--config", f["tmp"] + "/x.yaml"], {},
     ("--config", "TRAINGUARD_CONFIG"), "two config files"),
    ("show-set-bogus-key", lambda f: ["config", "show", "--set", "bogus.key=1"], {}, ("bogus.key", None), "unknown config key"),
    ("show-set-typo", lambda f: ["config", "show", "--set", "checkpoint.keep_lst=3"], {}, "checkpoint.keep_last",
     "unknown config key `checkpoint.keep_lst`"),
    ("set-without-equals", lambda f: ["config", "show", "--set", "checkpoint.keep_last"], {}, ("--set", None), "KEY=VALUE"),
    ("rdzv-conf-unknown", lambda f: ["config", "show", "--rdzv-conf", "bogus=1"], {}, ("--rdzv-conf", None), "unknown --rdzv-conf"),
    ("last-call-timeout-0", lambda f: ["config", "check", f["yaml"]("a.yaml", "rendezvous:\n  last_call_timeout_s: 0\n")], {},
     "rendezvous.last_call_timeout_s", "must be > 0"),
    ("close-timeout-negative", lambda f: ["config", "check", f["yaml"]("a.yaml", "rendezvous:\n  close_timeout_s: -5\n")], {},
     "rendezvous.close_timeout_s", "must be > 0"),
    ("join-timeout-inf", lambda f: ["config", "check", f["yaml"]("a.yaml", "rendezvous:\n  join_timeout_s: .inf\n")], {},
     "rendezvous.join_timeout_s", "finite"),
    ("exit-barrier-negative", lambda f: ["config", "check", f["yaml"]("a.yaml", "workers:\n  exit_barrier_timeout_s: -1\n")], {},
     "workers.exit_barrier_timeout_s", "must be > 0"),
    ("env-value-list", lambda f: ["config", "check", f["yaml"]("a.yaml", f"workers:\n  env:\n    TOKEN: [{SECRET}]\n")], {},
     "workers.env", "values must be strings"),
    ("duplicate-yaml-key", lambda f: ["config", "check", f["yaml"]("a.yaml", "agent:\n  job_id: a\n  job_id: b\n")], {},
     ("--config", "TRAINGUARD_CONFIG"), "duplicate key 'job_id'"),
    ("s3-without-bucket", lambda f: ["config", "check", f["yaml"]("a.yaml", "checkpoint:\n  url: 's3://'\n")], {},
     "checkpoint.url", "names no bucket"),
    ("job-id-dotdot", lambda f: ["config", "check", f["yaml"]("a.yaml", "agent:\n  job_id: '..'\n")], {}, "agent.job_id",
     "starting with a letter or digit"),
    ("storage-options-bad-json", lambda f: ["config", "show"], {"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": f'{{"key": "{SECRET}",'},
     "checkpoint.storage_options", "not a JSON object"),
    ("run-missing-script", lambda f: run_args(f)[:-1] + [f["tmp"] + "/no_such_train.py"], {}, "workers.entrypoint",
     "does not exist"),
    ("run-missing-price-table", lambda f: run_args(f, "--set", "cost.instance_type=g5", "--set",
                                                   f"cost.price_table_file={f['tmp']}/prices.yaml"), {},
     "cost.price_table_file", "file not found"),
    ("run-checkpoint-under-a-file", lambda f: run_args(f, "--set", f"checkpoint.url=file://{f['script']}/ckpt"), {},
     "checkpoint.url", "is not a folder"),
    ("run-s3-without-bucket", lambda f: run_args(f, "--set", "checkpoint.url=s3://"), {}, "checkpoint.url", "names no bucket"),
    ("run-socket-path-too-long", lambda f: run_args(f, "--rdzv-id", "j" * 120), {}, "agent.state_dir", "Unix sockets allow 107"),
    ("drain-nobody-there", lambda f: ["drain", "--state-dir", f["tmp"]], {}, "agent.state_dir", "no live agent"),
    ("drain-socket-missing", lambda f: ["drain", "--socket", f["tmp"] + "/x.sock"], {}, ("--socket", None), "no agent listening"),
    ("drain-zero-deadline", lambda f: ["drain", "--deadline", "0"], {}, None, None),  # argparse: usage + exit 2
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_exits_2_with_one_line(row, files, capsys, monkeypatch):
    name, argv, env, key, fragment = row
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("trainguard.agent.daemon.run_agent", _tripwire)
    monkeypatch.chdir(files["tmp"])
    try:
        rc = cli.main(argv(files))
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and SECRET not in err, err
    if key is None:
        assert "usage: trainguard" in err and "must be > 0" in err
        return
    lines = [ln for ln in err.splitlines() if ln.startswith("trainguard: ")]
    assert len(lines) == 1, err
    m = LINE.match(lines[-1])
    assert m, f"not `trainguard: <what> (<key> / <env>): <fix>`: {lines[-1]}"
    yaml_key, env_var = key if isinstance(key, tuple) else (key, env_var_for(key))
    assert m["where"] == (f"{yaml_key} / {env_var}" if env_var else yaml_key), lines[-1]
    assert fragment in m["what"], lines[-1]
    assert m["fix"].strip(), lines[-1]


def _tripwire(*a, **k):
    raise AssertionError("the agent started although the pre-flight checks should have refused")


def test_drain_against_a_socket_that_never_answers(tmp_path, capsys):
    path = str(tmp_path / "wedged.sock")
    srv, _ = _silent_server(path)
    try:
        rc = cli.main(["drain", "--socket", path, "--timeout", "0.5"])
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert LINE.match(err.strip()) and "did not answer within 0.5s" in err and "(--socket)" in err


def test_drain_permission_denied(tmp_path, capsys, monkeypatch):
    """Root passes any permission check, so the denial is injected where the CLI meets the socket."""
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(control, "request", denied)
    assert cli.main(["drain", "--socket", str(tmp_path / "x.sock")]) == 2
    err = capsys.readouterr().err
    assert "permission denied" in err and "run as the agent's user" in err and LINE.match(err.strip())


def test_state_dir_owned_by_another_user_is_refused(files, capsys, monkeypatch):
    state = os.path.join(files["tmp"], "foreign")
    os.mkdir(state, 0o700)
    os.chown(state, 65534, 65534)
    monkeypatch.setattr("trainguard.agent.daemon.run_agent", _tripwire)
    argv = run_args(files)
    argv[argv.index("--state-dir") + 1] = state
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "(agent.state_dir / TRAINGUARD_AGENT_STATE_DIR)" in err and "belongs to uid 65534" in err


def test_world_writable_state_dir_is_refused(files, capsys, monkeypatch):
    state = os.path.join(files["tmp"], "open")
    os.mkdir(state)
    os.chmod(state, 0o777)
    monkeypatch.setattr("trainguard.agent.daemon.run_agent", _tripwire)
    argv = run_args(files)
    argv[argv.index("--state-dir") + 1] = state
    assert cli.main(argv) == 2
    assert "writable by group or others (mode 0777)" in capsys.readouterr().err


def test_second_agent_on_a_live_socket_is_refused(files, capsys, monkeypatch):
    state = os.path.join(files["tmp"], "state")
    os.makedirs(state, 0o700)
    live = control.ControlServer(proto.control_socket_path(state, "job1"),
                                 lambda m: proto.Reply(ok=True, data={"job_id": "job1"}))
    monkeypatch.setattr("trainguard.agent.daemon.run_agent", _tripwire)
    try:
        assert cli.main(run_args(files, "--rdzv-id", "job1")) == 2
        err = capsys.readouterr().err
        assert "another agent is already running job 'job1'" in err and "(agent.job_id / TRAINGUARD_AGENT_JOB_ID)" in err
        # the first agent is untouched: its socket still answers
        assert control.request(live.path, proto.StatusRequest()).ok
    finally:
        live.close()


@pytest.mark.parametrize("argv", [
    ["config", "check", "/"],
    ["config", "show", "--set", "checkpoint.keep_lst=3"],
    ["config", "show", "--set", "bogus.key=1"],
])
def test_real_process_prints_no_traceback(argv):
    r = subprocess.run([sys.executable, "-m", "trainguard.agent.cli", *argv], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert LINE.match(r.stderr.strip()), r.stderr
