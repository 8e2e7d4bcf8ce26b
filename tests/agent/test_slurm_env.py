"""Slurm's environment -> config defaults (:mod:`trainguard.agent.slurm`), table-tested, and the hostlist
parser checked against ``scontrol show hostnames`` where Slurm is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import REPO
from trainguard.agent import slurm
from trainguard.agent.configload import load_config
from trainguard.contract.configbase import ConfigError

HOSTLISTS = [
    ("node1", ["node1"]),
    ("tg[1-2]", ["tg1", "tg2"]),
    ("gpu[01-03,7],login", ["gpu01", "gpu02", "gpu03", "gpu7", "login"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("b-[8-9]c[1-2]", ["b-8c1", "b-8c2", "b-9c1", "b-9c2"]),
    ("a,b[2],c[0-1]", ["a", "b2", "c0", "c1"]),
    ("r1n[1-2],r2n[5]", ["r1n1", "r1n2", "r2n5"]),
]


OURS_ONLY = [("c-[0-1]-x", ["c-0-x", "c-1-x"])]  # Slurm 22.05's scontrol refuses a suffix after a range


@pytest.mark.parametrize("text,hosts", HOSTLISTS + OURS_ONLY)
def test_expand_hostlist(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[1-2", "a]1[", "a[x]", "a[3-1]", "a[[1]]", "a[1-]"])
def test_expand_hostlist_rejects(text):
    with pytest.raises(slurm.HostlistError):
        slurm.expand_hostlist(text)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol not installed (Debian slurm-client)")
def test_expand_hostlist_matches_scontrol(tmp_path):
    """``scontrol show hostnames`` expands offline but wants a config file to read; a minimal one does."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=x\nPartitionName=p Nodes=x\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for text, _ in HOSTLISTS:
        got = subprocess.run(["scontrol", "show", "hostnames", text], env=env, capture_output=True, text=True,
                             timeout=30)
        assert got.returncode == 0, got.stderr
        assert slurm.expand_hostlist(text) == got.stdout.split(), text


BASE = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "gpu07", "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0"}
BATCH = {k: v for k, v in BASE.items() if k != "SLURM_STEP_ID"}
"""The batch script's own environment: no job step."""

CASES = [
    # (env, facts, expected values)
    ({}, None, {}),
    ({"SLURMD_NODENAME": "x"}, None, {}),  # no job id: not a Slurm job step
    (BASE, None, {"agent.job_id": "slurm-4242", "agent.node_name": "gpu07", "rendezvous.min_nodes": "4",
                  "rendezvous.max_nodes": "4", "rendezvous.endpoint": "gpu07:19242", "preemption.sigusr1": "true"}),
    ({**BASE, "SLURM_RESTART_COUNT": "2"}, None,  # a requeued job keeps its id: it resumes its checkpoints
     {"agent.job_id": "slurm-4242"}),
    ({**BASE, "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "103"}, None,
     {"agent.job_id": "slurm-100_3", "rendezvous.endpoint": "gpu07:15103"}),
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODELIST": "a,b", "SLURM_STEP_ID": "1"}, None,
     {"rendezvous.min_nodes": "2", "rendezvous.endpoint": "a:15007"}),
    # the batch shell of a 4-node job is one node: no node count, no endpoint (the line says why)
    (BATCH, None, {"agent.job_id": "slurm-4242", "rendezvous.min_nodes": None, "rendezvous.endpoint": None}),
    # the batch shell of a 1-node job is the whole job
    ({**BATCH, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu07"}, None,
     {"rendezvous.min_nodes": "1", "rendezvous.endpoint": "gpu07:19242"}),
    ({**BASE, "SLURM_GPUS_ON_NODE": "8"}, None, {"workers.nproc_per_node": "8"}),
    ({**BASE, "SLURM_GPUS_ON_NODE": "0"}, None, {"workers.nproc_per_node": None}),
    # a SIGTERM may be either: the shorter window of the two
    (BASE, slurm.SchedulerFacts(grace_time_s=20, kill_wait_s=30, preemptable=True),
     {"preemption.signal_deadline_s": "20"}),
    (BASE, slurm.SchedulerFacts(grace_time_s=90, kill_wait_s=30, preemptable=True),
     {"preemption.signal_deadline_s": "30"}),
    (BASE, slurm.SchedulerFacts(grace_time_s=90, kill_wait_s=0, preemptable=True),
     {"preemption.signal_deadline_s": "90"}),
    (BASE, slurm.SchedulerFacts(grace_time_s=90, kill_wait_s=30, preemptable=False),
     {"preemption.signal_deadline_s": "30"}),
    (BASE, slurm.SchedulerFacts(grace_time_s=0, kill_wait_s=0, preemptable=True),
     {"preemption.signal_deadline_s": None}),
]


@pytest.mark.parametrize("env,facts,expected", CASES)
def test_slurm_defaults(env, facts, expected):
    got = slurm.slurm_defaults(env, facts)
    for key, value in expected.items():
        assert got.values.get(key) == value, key
    assert set(got.values) == set(got.origins)
    if not env.get("SLURM_JOB_ID"):
        assert got.values == {}


@pytest.mark.parametrize("env,key,names", [
    ({**BASE, "SLURM_JOB_NODELIST": "gpu[07-"}, "rendezvous.endpoint", "SLURM_JOB_NODELIST"),
    ({**BASE, "SLURM_JOB_NUM_NODES": "four"}, "rendezvous.min_nodes", "SLURM_JOB_NUM_NODES"),
])
def test_slurm_defaults_bad_input_names_variable_key_and_fix(env, key, names):
    with pytest.raises(ConfigError) as e:
        slurm.slurm_defaults(env)
    text = str(e.value)
    assert names in text and key in text and "TRAINGUARD_" in text and "pass --" in text


def test_defaults_lose_to_env_and_flags_and_the_line_says_which():
    sd = slurm.slurm_defaults(BASE, slurm.SchedulerFacts(grace_time_s=60, preemptable=True))
    cfg = load_config(None, {"TRAINGUARD_AGENT_JOB_ID": "mine"}, {"rendezvous.min_nodes": "2"},
                      defaults=sd.values)
    assert cfg.agent.job_id == "mine"
    assert (cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes) == (2, 4)
    assert cfg.rendezvous.endpoint == "gpu07:19242" and cfg.agent.node_name == "gpu07"
    assert cfg.preemption.sigusr1 is True and cfg.preemption.signal_deadline_s == 60
    line = slurm.describe(sd, slurm.effective(cfg, sd))
    assert "\n" not in line
    assert line.startswith("from Slurm: ")
    assert "agent.node_name=gpu07 (SLURMD_NODENAME)" in line
    assert "rendezvous.endpoint=gpu07:19242 (first host of SLURM_JOB_NODELIST)" in line
    assert "preemption.signal_deadline_s=60 (partition GraceTime (scontrol))" in line
    used, _, elsewhere = line.partition("; set elsewhere")
    assert "agent.job_id" not in used and "rendezvous.min_nodes" not in used
    assert "agent.job_id" in elsewhere and "rendezvous.min_nodes" in elsewhere
    assert "rendezvous.max_nodes" not in elsewhere


def test_the_batch_shell_line_says_to_use_srun():
    sd = slurm.slurm_defaults(BATCH)
    line = slurm.describe(sd, slurm.effective(load_config(None, {}, defaults=sd.values), sd))
    assert "\n" not in line and "not in a job step" in line and "srun --ntasks-per-node=1" in line


def test_parse_scontrol():
    part = ("PartitionName=low AllowGroups=ALL GraceTime=45 Hidden=NO PreemptMode=REQUEUE State=UP "
            "Nodes=tg[1-2]")
    conf = "Configuration data as of x\nKillWait                = 30 sec\nPreemptMode             = REQUEUE\n"
    assert slurm.parse_scontrol(part, conf) == slurm.SchedulerFacts(45, 30, True)
    assert slurm.parse_scontrol(part.replace("PreemptMode=REQUEUE", "PreemptMode=OFF"), conf).preemptable is False
    assert slurm.parse_scontrol("", "") == slurm.SchedulerFacts(0, 0, False)


def test_cli_prints_one_line_of_what_came_from_slurm(tmp_path):
    """``trainguard config show`` is not wired to Slurm; ``run`` is: a bad nodelist fails it at load with
    the variable, the key and the fix on one line (exit 2), before anything starts."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "SLURM"))},
           **BASE, "SLURM_JOB_NODELIST": "gpu[07-", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "run", "x.py"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLURM_JOB_NODELIST" in lines[0] and "--rdzv-endpoint" in lines[0], out.stderr
