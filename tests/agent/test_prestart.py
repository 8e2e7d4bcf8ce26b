"""Prestarted worker interpreters (agent/prestart.py, runtime/warm.py): the pure rules, table-tested,
then real interpreters handed over, refused and ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from trainguard.agent import prestart, workerenv
from trainguard.agent.config import TrainguardConfig, WorkersConfig
from trainguard.agent.configload import load_config
from trainguard.contract.configbase import ConfigError
from trainguard.runtime.warm import AGENT_PID_ENV, IMPORTS_ENV

SHIM = ("-m", "trainguard.runtime.shim", "--")


@pytest.mark.parametrize(("name", "identity"), [
    ("RANK", True), ("LOCAL_RANK", True), ("MASTER_PORT", True), ("TORCHELASTIC_RESTART_COUNT", True),
    ("TRAINGUARD_RT_ROUND", True), ("TRAINGUARD_PRESTART_IMPORTS", True),
    ("OMP_NUM_THREADS", False), ("CUDA_VISIBLE_DEVICES", False), ("PROMETHEUS_MULTIPROC_DIR", False),
    ("TRAINGUARD_CHECKPOINT_URL", False), ("PYTHONPATH", False), ("RANKS", False),
])
def test_identity_variables(name: str, identity: bool) -> None:
    assert prestart.is_identity(name) is identity


@pytest.mark.parametrize(("started", "final", "differ"), [
    ({"A": "1", "RANK": "-1"}, {"A": "1", "RANK": "3"}, []),                       # ranks are set at the hand-over
    ({"A": "1", IMPORTS_ENV: "torch", AGENT_PID_ENV: "1"}, {"A": "1"}, []),         # the prestart's own variables
    ({"A": "1"}, {"A": "1", "TRAINGUARD_RT_STANDBY": "1", "WORLD_SIZE": "-1"}, []),
    ({"A": "1"}, {"A": "2"}, ["A"]),                                                # an import may have read it
    ({"A": "1"}, {"A": "1", "OMP_NUM_THREADS": "1"}, ["OMP_NUM_THREADS"]),          # set in the final one only
    ({"A": "1", "B": "x"}, {"A": "1"}, ["B"]),                                      # gone from the final one
])
def test_env_mismatch(started: dict[str, str], final: dict[str, str], differ: list[str]) -> None:
    assert prestart.env_mismatch(started, final) == differ


@pytest.mark.parametrize(("args", "expected"), [
    ((*SHIM, "-u", "train.py", "--lr", "1"), (["-u"], ["train.py", "--lr", "1"])),
    ((*SHIM, "-u", "-m", "pkg.train", "x"), (["-u"], ["-m", "pkg.train", "x"])),
    ((*SHIM, "train.py"), ([], ["train.py"])),
    ((*SHIM, "-X", "dev", "train.py"), None),                           # a flag with a value: not handled
    ((*SHIM, "-u", "-m"), None),
    (("-m", "trainguard.runtime.shim", "--no-python", "--", "./bin"), None),  # not a Python program
    (("train.py",), None),
])
def test_spare_program(args: tuple[str, ...], expected: tuple[list[str], list[str]] | None) -> None:
    assert prestart.spare_program(args) == expected


def test_spare_command_runs_the_program_the_shim_would() -> None:
    cfg = WorkersConfig(entrypoint="train.py", args=["--steps", "5"])
    python, args = workerenv.worker_command(cfg)
    assert prestart.spare_command(python, args, 9) == [python, "-u", "-m", prestart.WARM_MODULE, "9", "--",
                                                        "train.py", "--steps", "5"]


def test_spare_env_carries_what_the_worker_will_inherit() -> None:
    cfg = TrainguardConfig(workers=WorkersConfig(entrypoint="t.py", nproc_per_node=2, env={"NCCL_DEBUG": "WARN"}))
    env = prestart.spare_env(cfg, {"PATH": "/bin"}, agent_pid=42)
    assert env["PATH"] == "/bin" and env["NCCL_DEBUG"] == "WARN"
    assert env["OMP_NUM_THREADS"] == "1"  # torchrun's default for several workers
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["PROMETHEUS_MULTIPROC_DIR"].endswith("prometheus_multiproc")  # read by prometheus_client at import
    assert env[AGENT_PID_ENV] == "42" and env[IMPORTS_ENV].split() == list(cfg.workers.prestart_imports)
    off = TrainguardConfig(workers=WorkersConfig(entrypoint="t.py"))
    off.metrics.enabled = False
    assert "PROMETHEUS_MULTIPROC_DIR" not in prestart.spare_env(off, {}, agent_pid=1)


def test_prestart_settings_load_from_env_and_bad_names_are_refused() -> None:
    cfg = load_config(None, {"TRAINGUARD_WORKERS_PRESTART": "false", "TRAINGUARD_WORKERS_PRESTART_IMPORTS": "torch numpy"})
    assert cfg.workers.prestart is False and cfg.workers.prestart_imports == ["torch", "numpy"]
    with pytest.raises(ConfigError) as err:
        load_config(None, {"TRAINGUARD_WORKERS_PRESTART_IMPORTS": "torch not-a-module"})
    assert "workers.prestart_imports" in str(err.value) and "not-a-module" in str(err.value)


# ---- real interpreters ----------------------------------------------------------------------------
PROGRAM = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                      "imports": os.environ.get("TRAINGUARD_PRESTART_IMPORTS"), "mark": os.environ.get("MARK"),
                      "preloaded": "decimal" in sys.modules, "pid": os.getpid()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("EXIT", "0")))
""")


def _spare(tmp_path, extra_env: dict[str, str] | None = None) -> tuple[prestart.Spare, str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    worker = (sys.executable, (*SHIM, "-u", str(script), "--flag"))
    env = {**os.environ, "MARK": "started", IMPORTS_ENV: "decimal", AGENT_PID_ENV: str(os.getpid()), **(extra_env or {})}
    return prestart.Spare(0, worker, env), str(script)


def test_a_handed_over_interpreter_runs_the_program_as_python_would(tmp_path) -> None:
    spare, script = _spare(tmp_path)
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    final = {**spare.env, "RANK": "3", "EXIT": "7"}
    del final[IMPORTS_ENV]
    assert spare.hand_over(final, out, err)
    assert spare.proc.wait(30) == 7  # the program's exit code is the process's
    out.close(), err.close()
    got = json.loads((tmp_path / "out").read_text())
    assert got["name"] == "__main__" and got["argv"] == [script, "--flag"] and got["path0"] == str(tmp_path)
    assert got["rank"] == "3" and got["imports"] is None  # the final environment replaced the start's
    assert got["preloaded"] is True and got["pid"] == spare.proc.pid
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_a_discarded_interpreter_ends_without_running_the_program(tmp_path) -> None:
    spare, _ = _spare(tmp_path, {"EXIT": "5"})  # the program, had it run, would exit 5
    spare.discard()
    assert spare.proc.returncode in (0, -9)  # its socket closed, or killed mid-import
    late, _ = _spare(tmp_path, {"EXIT": "5"})
    late._sock.shutdown(socket.SHUT_WR)  # end of file only, no hand-over: it exits 0 by itself after its imports
    assert late.proc.wait(30) == 0
    late.discard()


def test_an_interpreter_whose_agent_is_not_its_parent_runs_nothing(tmp_path) -> None:
    spare, _ = _spare(tmp_path, {AGENT_PID_ENV: "1"})
    assert spare.proc.wait(30) == 0
    assert not spare.hand_over({**spare.env}, None, None)  # gone: the handler starts a fresh worker


def test_take_refuses_a_changed_environment_and_ends_the_interpreter(tmp_path, monkeypatch) -> None:
    spare, script = _spare(tmp_path)
    monkeypatch.setattr(prestart, "_pool", {0: spare, 1: _spare(tmp_path)[0]})
    args = (*SHIM, "-u", script, "--flag")
    assert prestart.take(0, sys.executable, args, {**spare.env, "MARK": "changed"}) is None
    assert spare.proc.poll() in (0, -9)  # ended
    other = prestart._pool[1]
    assert prestart.take(1, sys.executable, (*SHIM, "-u", script, "--other"), dict(other.env)) is None  # another command
    assert other.proc.poll() in (0, -9) and prestart.pending() == 0


def test_take_adopts_when_only_identity_variables_differ(tmp_path, monkeypatch) -> None:
    spare, script = _spare(tmp_path)
    monkeypatch.setattr(prestart, "_pool", {0: spare})
    final = {**spare.env, "RANK": "0", "TORCHELASTIC_RUN_ID": "x", "TRAINGUARD_RT_ROUND": "2"}
    assert prestart.take(0, sys.executable, (*SHIM, "-u", script, "--flag"), final) is spare
    assert prestart.pending() == 0
    spare.discard()


def test_close_ends_every_interpreter_not_adopted(tmp_path, monkeypatch) -> None:
    spares = [_spare(tmp_path)[0] for _ in range(2)]
    monkeypatch.setattr(prestart, "_pool", dict(enumerate(spares)))
    prestart.close("test")
    assert all(s.proc.poll() in (0, -9) for s in spares) and prestart.pending() == 0


def test_run_program_runs_a_module_as_python_m(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(PROGRAM)
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "from trainguard.runtime.warm import run_program; run_program(['-m', 'pkgx.job', 'a'])",
                          str(tmp_path)], capture_output=True, text=True, timeout=60, env={**os.environ, "EXIT": "0"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[0])
    assert got["name"] == "__main__" and got["argv"] == [str(pkg / "job.py"), "a"]


def test_elastic_handler_adopts_the_interpreter_or_starts_a_fresh_worker(tmp_path, monkeypatch) -> None:
    from trainguard.agent import prestart_handler

    monkeypatch.setenv("MARK", "started")  # the agent's environment, which the handler adds to the worker's
    spare, script = _spare(tmp_path)
    args = (*SHIM, "-u", script, "--flag")
    monkeypatch.setattr(prestart, "_pool", {0: spare})
    h = prestart_handler.handler(sys.executable, args, {"RANK": "0"}, str(tmp_path / "o0"), str(tmp_path / "e0"), 0)
    assert isinstance(h, prestart_handler.PrestartedHandler) and h.proc is spare.proc
    assert h.proc.wait(30) == 0
    assert json.loads((tmp_path / "o0").read_text())["rank"] == "0"

    other, _ = _spare(tmp_path)
    monkeypatch.setattr(prestart, "_pool", {0: other})
    h = prestart_handler.handler(sys.executable, args, {"RANK": "0", "MARK": "changed"}, str(tmp_path / "o1"),
                                 str(tmp_path / "e1"), 0)
    assert not isinstance(h, prestart_handler.PrestartedHandler) and h.proc.pid != other.proc.pid
    assert other.proc.poll() in (0, -9)  # refused, ended
    assert h.proc.wait(60) == 0
    got = json.loads((tmp_path / "o1").read_text())
    assert got["mark"] == "changed" and got["preloaded"] is False  # a fresh interpreter, through the shim

    gone, _ = _spare(tmp_path)
    monkeypatch.setattr(prestart, "_pool", {0: gone})
    monkeypatch.setattr(gone, "hand_over", lambda *a: False)  # the interpreter died between take and start
    h = prestart_handler.handler(sys.executable, args, {"RANK": "0"}, str(tmp_path / "o2"), str(tmp_path / "e2"), 0)
    assert h.proc.pid != gone.proc.pid and h.proc.wait(60) == 0 and gone.proc.poll() in (0, -9)
