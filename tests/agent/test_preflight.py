"""Pure checks and small pieces of the start path: private runtime dirs, pre-flight checks, start-up
warnings, torchrun-parity worker env, the standalone job id, torch's misleading log lines, and the
read-only views of ``status`` and ``checkpoints show``."""

from __future__ import annotations

import argparse
import io
import logging
import os
import stat
import sys

import pytest
import structlog
import torch._dynamo  # noqa: F401 - its lazy import (first DCP save) sets TORCHINDUCTOR_CACHE_DIR: before the leak guard

from trainguard.agent import preflight, rundir, torchlogs, workerenv
from trainguard.agent.cli import standalone_job_id
from trainguard.agent.config import RendezvousConfig, WorkersConfig
from trainguard.agent.configload import load_config
from trainguard.contract.configbase import ConfigError

# ---- runtime directory ----------------------------------------------------------------------------


def test_default_state_dir_order(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    assert rundir.default_state_dir({"RUNTIME_DIRECTORY": "/run/trainguard:/run/other", "XDG_RUNTIME_DIR": str(xdg)}) == \
        "/run/trainguard"
    assert rundir.default_state_dir({"XDG_RUNTIME_DIR": str(xdg)}) == str(xdg / "trainguard")
    monkeypatch.setattr(rundir.tempfile, "gettempdir", lambda: str(tmp_path))
    base = str(tmp_path / f"trainguard-{os.getuid()}")
    assert rundir.default_state_dir({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == os.path.join(base, "state")
    os.chown(xdg, 65534, 65534)  # a session dir of another user is not ours to use
    assert rundir.default_state_dir({"XDG_RUNTIME_DIR": str(xdg)}) == os.path.join(base, "state")
    assert rundir.default_state_dir({"XDG_RUNTIME_DIR": "relative/dir"}) == os.path.join(base, "state")
    # the loader fills an empty agent.state_dir with it
    assert load_config(None, {"XDG_RUNTIME_DIR": str(tmp_path / "missing")}).agent.state_dir == os.path.join(base, "state")


def test_ensure_private_dir_creates_0700_and_refuses_what_is_not_ours(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.tempfile, "gettempdir", lambda: str(tmp_path))
    made = rundir.ensure_private_dir(os.path.join(rundir.private_base(), "state"))
    for d in (rundir.private_base(), made):
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert rundir.ensure_private_dir(made) == made  # idempotent

    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534") as ei:
        rundir.ensure_private_dir(str(other))
    assert ei.value.key == "agent.state_dir"
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        rundir.ensure_private_dir(str(other / "sub"))  # root could create it there: still refused

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o1777)
    with pytest.raises(ConfigError, match=r"writable by group or others \(mode 1777\)"):
        rundir.ensure_private_dir(str(open_dir))

    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        rundir.ensure_private_dir(str(tmp_path / "link"))

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        rundir.ensure_private_dir(str(afile))


def test_a_pre_created_shared_base_is_refused(tmp_path, monkeypatch):
    """Another local user creates /tmp/trainguard-<uid> first: `trainguard run` must not use it."""
    monkeypatch.setattr(rundir.tempfile, "gettempdir", lambda: str(tmp_path))
    base = rundir.private_base()
    os.mkdir(base, 0o777)
    os.chmod(base, 0o777)
    os.chown(base, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        rundir.ensure_private_dir(os.path.join(base, "state"))


def test_candidate_state_dirs_exist_and_are_unique(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.tempfile, "gettempdir", lambda: str(tmp_path))
    rt = tmp_path / "rt"
    rt.mkdir()
    dirs = rundir.candidate_state_dirs({"RUNTIME_DIRECTORY": str(rt)})
    assert dirs[0] == str(rt) and len(dirs) == len(set(dirs)) and all(os.path.isdir(d) for d in dirs)


# ---- pre-flight checks ------------------------------------------------------------------------------


def test_entrypoint_checks(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    ok = [WorkersConfig(entrypoint="train.py"), WorkersConfig(entrypoint=str(tmp_path / "train.py")),
          WorkersConfig(entrypoint="mypkg.train", module=True), WorkersConfig(entrypoint="json.tool", module=True),
          WorkersConfig(entrypoint=sys.executable, no_python=True), WorkersConfig(entrypoint="true", no_python=True)]
    for w in ok:
        preflight.check_entrypoint(w, cwd=str(tmp_path))
    bad = [(WorkersConfig(entrypoint="trian.py"), "does not exist"), (WorkersConfig(entrypoint="pkgdir"), "is a directory"),
           (WorkersConfig(entrypoint="nopkg.train", module=True), "module 'nopkg.train' not found"),
           (WorkersConfig(entrypoint="no-such-binary-xyz", no_python=True), "not found"),
           (WorkersConfig(), "no training script")]
    for w, fragment in bad:
        with pytest.raises(ConfigError, match=fragment) as ei:
            preflight.check_entrypoint(w, cwd=str(tmp_path))
        assert ei.value.key == "workers.entrypoint"


@pytest.mark.parametrize("url,fragment", [
    ("", None), ("s3://bucket/prefix", None), ("gs://b", None), ("memory://x", None),
    ("s3://", "names no bucket"), ("gs:///prefix", "names no bucket"),
    ("{tmp}/new/deeper", None), ("file://{tmp}/new", None), ("{tmp}/afile/ckpt", "is not a folder"),
])
def test_checkpoint_url_checks(tmp_path, url, fragment):
    (tmp_path / "afile").write_text("x")
    url = url.format(tmp=tmp_path)
    if fragment is None:
        preflight.check_checkpoint_url(url)
        assert not os.path.exists(tmp_path / "new")  # checked, not created
    else:
        with pytest.raises(ConfigError, match=fragment) as ei:
            preflight.check_checkpoint_url(url)
        assert ei.value.key == "checkpoint.url"


def test_unwritable_checkpoint_folder(tmp_path, monkeypatch):
    """Root may write anywhere, so the permission answer is injected."""
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False)
    with pytest.raises(ConfigError, match="cannot create .* under"):
        preflight.check_checkpoint_url(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("kw,expected", [
    ({"max_nodes": 1}, False),                                           # single node: nothing to lose
    ({"max_nodes": 4, "is_host": False}, False),                         # store elsewhere
    ({"max_nodes": 4, "is_host": True}, True),
    ({"max_nodes": 4, "endpoint": "127.0.0.1:29400"}, True),             # torchrun's rule: local endpoint hosts
    ({"max_nodes": 4, "endpoint": "localhost:29400"}, True),
    ({"max_nodes": 4, "endpoint": "192.0.2.10:29400"}, False),           # TEST-NET: not this machine
    ({"max_nodes": 4, "backend": "etcd-v2", "endpoint": "127.0.0.1:2379"}, False),
])
def test_store_in_agent(kw, expected):
    r = RendezvousConfig(**{"min_nodes": 1, **kw})
    assert preflight.store_in_agent(r) is expected


def test_startup_warnings():
    cfg = load_config(None, {}, {"rendezvous.max_nodes": "3", "rendezvous.endpoint": "127.0.0.1:1234",
                                 "workers.nproc_per_node": "2", "agent.state_dir": "/x"})
    names = {w.event for w in preflight.warnings(cfg, {})}
    assert names == {"store_in_agent", "omp_num_threads_defaulted"}
    assert {w.event for w in preflight.warnings(cfg, {"OMP_NUM_THREADS": "4"})} == {"store_in_agent"}


@pytest.mark.parametrize("nproc,inherited,env,expected", [
    (2, {}, {}, {"OMP_NUM_THREADS": "1"}),
    (1, {}, {}, {}),
    (2, {"OMP_NUM_THREADS": "8"}, {}, {}),
    (2, {}, {"OMP_NUM_THREADS": "3"}, {}),
])
def test_torchrun_omp_default(nproc, inherited, env, expected):
    assert workerenv.torchrun_defaults(WorkersConfig(nproc_per_node=nproc, env=env), inherited) == expected
    assert workerenv.ROLE == "default"


# ---- the standalone job id ------------------------------------------------------------------------


def test_standalone_job_id_is_stable_and_names_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = standalone_job_id("train.py", ["--steps", "50"])
    assert a == standalone_job_id(str(tmp_path / "train.py"), ["--steps", "50"])  # same file, same args
    assert a.startswith("train-") and len(a) == len("train-") + 8
    assert a != standalone_job_id("train.py", ["--steps", "51"])
    assert a != standalone_job_id("other/train.py", ["--steps", "50"])
    assert standalone_job_id("pkg.mod.train_gpt", [], module=True).startswith("train_gpt-")
    load_config(None, {}, {"agent.job_id": standalone_job_id("we ird!.py", [])})  # always a valid job id


# ---- torch's misleading lines -----------------------------------------------------------------------


def test_torch_elastic_noise_is_filtered_and_explained_once():
    torchlogs.install()
    torchlogs.install()  # idempotent
    logger = logging.getLogger(torchlogs.ELASTIC_MP_LOGGER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                logger.warning("Failed to register signal handlers since torchelastic is running on a child thread. "
                               "This could lead to orphaned worker processes if the torchrun is terminated.")
            logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 75, 0, 1, "python")
            logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 1, "python")
            with torchlogs.expected_stop():
                logger.warning("Sending process %s closing signal %s", 101, "SIGTERM")  # a drain's: planned
            with torchlogs.expected_stop(False):
                logger.warning("Sending process %s closing signal %s", 102, "SIGTERM")  # after a crash
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "Failed to register" not in out and "exitcode: 75" not in out
    assert "failed (exitcode: 1)" in out  # real failures still show
    assert "Sending process 101" not in out and "Sending process 102 closing signal SIGTERM" in out
    assert [e["event"] for e in logs].count("orphan_safety") <= 1  # once per process (maybe already said)


# ---- status before the first checkpoint; checkpoints show on a run folder ---------------------------


def test_status_before_the_first_checkpoint():
    from trainguard.metrics.status import build_view, format_view

    samples = {"trainguard_checkpoint_last_committed_step": [({}, 0.0)],
               "trainguard_checkpoint_last_commit_timestamp_seconds": [({}, 0.0)],
               "trainguard_agent_state": [({"state": "running"}, 1.0)]}
    text = format_view(build_view(samples, now=1_795_428_760.0))
    assert "last checkpoint   none yet" in text and "s ago" not in text
    samples["trainguard_checkpoint_last_committed_step"] = [({}, 40.0)]
    samples["trainguard_checkpoint_last_commit_timestamp_seconds"] = [({}, 1_795_428_700.0)]
    assert "step 40, 60 s ago" in format_view(build_view(samples, now=1_795_428_760.0))


def test_checkpoints_show_accepts_the_run_folder(tmp_path, capsys):
    import torch

    from trainguard.checkpoint import cli as ckcli
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    url = f"file://{tmp_path}/ck"
    with CheckpointManager(CheckpointConfig(url=url), "run-a", rank=0, world_size=1) as mgr:
        mgr.save(4, {"w": torch.zeros(2)}, kind="final", block=True)
    parser = argparse.ArgumentParser(prog="trainguard")
    ckcli.register(parser.add_subparsers(dest="cmd"))
    capsys.readouterr()
    for argv in (["checkpoints", "show", f"{url}/run-a", "4"], ["checkpoints", "show", f"{tmp_path}/ck/run-a/", "4"],
                 ["checkpoints", "ls", f"{url}/run-a"]):
        args = parser.parse_args(argv)
        assert args.func(args) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert "run-a" in out and "final" in out and "several runs" not in out


@pytest.mark.parametrize("reform,inherited,env,expected", [
    (True, {}, {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TORCH_FR_BUFFER_SIZE": "2000"}),
    (False, {}, {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TORCH_FR_BUFFER_SIZE": "2000"}),
    (True, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2000"}),
    (False, {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "64"}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
])
def test_gpu_worker_env_defaults(reform, inherited, env, expected):
    """NCCL failures surface (abort the communicator and survive to re-form, or tear the worker
    down), and CUDA numbers GPUs as NVML does; the user's own settings win."""
    assert workerenv.gpu_defaults(WorkersConfig(env=env), inherited, reform_in_process=reform) == expected


# ---- the workers' log format follows the agent's -----------------------------------------------------


@pytest.mark.parametrize("tee, configured, rendered, expected", [
    (True, "auto", "console", "console"),   # the agent on a terminal: its workers' tee'd lines too
    (True, "auto", "json", "json"),
    (True, "console", "console", "console"),
    (False, "auto", "console", ""),         # only in log files: the worker decides on its stderr (JSON)
    (False, "console", "console", "console"),
    (False, "json", "json", "json"),
])
def test_worker_log_format(tee, configured, rendered, expected):
    from trainguard.agent.config import WorkersConfig
    from trainguard.contract.protocol import ProtocolError, RuntimeEnv

    got = workerenv.worker_log_format(WorkersConfig(tee=tee), configured, rendered)
    assert got == expected
    assert RuntimeEnv.from_env(RuntimeEnv(log_format=got).to_env()).log_format == got
    with pytest.raises(ProtocolError, match="TRAINGUARD_RT_LOG_FORMAT='pretty'.*agent.log_format"):
        RuntimeEnv.from_env({"TRAINGUARD_RT_LOG_FORMAT": "pretty"})
