"""The CLI surface is frozen by a snapshot; --version and config check behave."""

import argparse
import json
import os
import subprocess
import sys

from trainguard.agent import __version__
from trainguard.agent.cli import build_parser, parse_duration

SNAPSHOT = os.path.join(os.path.dirname(__file__), "snapshots", "cli.json")


def surface(parser: argparse.ArgumentParser, prefix: str = "trainguard") -> dict[str, list[str]]:
    out = {prefix: sorted(s for a in parser._actions for s in a.option_strings)}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out.update(surface(sub, f"{prefix} {name}"))
    return out


def test_cli_snapshot():
    got = surface(build_parser())
    if os.environ.get("TG_UPDATE_SNAPSHOTS") == "1":
        with open(SNAPSHOT, "w") as fh:
            json.dump(got, fh, indent=1, sort_keys=True)
    with open(SNAPSHOT) as fh:
        assert got == json.load(fh)


def test_torchrun_flags_accepted_both_spellings():
    p = build_parser()
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        assert p.parse_args(["run", flag, "2", "t.py"]).nproc_per_node == "2"
    args = p.parse_args(["run", "--nnodes", "1:3", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379", "--rdzv-id", "j",
                         "--max-restarts", "1", "--monitor-interval", "1", "-m", "pkg.train", "--x"])
    assert (args.rdzv_backend, args.module, args.script, args.script_args) == ("etcd-v2", True, "pkg.train", ["--x"])


def test_parse_duration():
    assert parse_duration("30") == 30 and parse_duration("30s") == 30 and parse_duration("2m") == 120


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "trainguard.agent.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"trainguard {__version__}"
    for cmd in ([], ["run"], ["agent"], ["config", "check"], ["drain"]):
        r = run_cli(*cmd, "--help")
        assert r.returncode == 0 and "usage: trainguard" in r.stdout


def test_config_check(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("agent:\n  job_id: x\nworkers:\n  entrypoint: train.py\n")
    r = run_cli("config", "check", str(good))
    assert r.returncode == 0 and "OK" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("rendezvous:\n  min_nodes: 4\n  max_nodes: 2\n")
    r = run_cli("config", "check", str(bad))
    assert r.returncode == 2
    assert "rendezvous.max_nodes" in r.stderr and "TRAINGUARD_RENDEZVOUS_MAX_NODES" in r.stderr


def test_config_show_redacts(tmp_path):
    r = run_cli("config", "show", "--format", "json", "--set", 'checkpoint.storage_options={"secret": "hunter2"}')
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["checkpoint"]["storage_options"]["secret"] == "***"


def test_config_check_and_show_accept_the_same_forms(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("agent:\n  job_id: same-forms\nworkers:\n  args: ['--steps', '50']\n")
    for argv in (["config", "check", str(good)], ["config", "check", "--config", str(good)]):
        r = run_cli(*argv)
        assert r.returncode == 0 and f"{good}: OK" in r.stdout, r.stderr
    for argv in (["config", "show", str(good), "--format", "json"], ["config", "show", "--config", str(good), "--format", "json"]):
        r = run_cli(*argv)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["agent"]["job_id"] == "same-forms"
