"""docs/slurm.md and docs/kubernetes.md match the code: every config key, env var and file they name
exists, every example file is documented, and the Slurm table lists exactly what
:func:`trainguard.agent.slurm.slurm_defaults` sets and the variables it reads."""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.harness import REPO
from trainguard.agent import slurm
from trainguard.agent.configload import all_keys
from trainguard.contract.configbase import env_var_for

PAGES = {"docs/slurm.md": "examples/slurm/*.sbatch", "docs/kubernetes.md": "docker/kubernetes/*.yaml"}
_KEY = re.compile(r"`((?:agent|rendezvous|workers|checkpoint|preemption|metrics|cost)\.[a-z0-9_]+)`")
_ENV = re.compile(r"\b(TRAINGUARD_[A-Z0-9_]+)\b")
_PATH = re.compile(r"\b((?:docs|examples|docker|tests)/[A-Za-z0-9_./-]+\.(?:md|py|sbatch|yaml))")


def page(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as fh:
        return fh.read()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_names_real_keys_env_vars_and_files(name):
    text = page(name)
    keys, envs = set(all_keys()), {env_var_for(k) for k in all_keys()}
    named_keys, named_envs, paths = set(_KEY.findall(text)), set(_ENV.findall(text)), set(_PATH.findall(text))
    assert named_keys and named_envs and paths  # the patterns found something to check
    assert named_keys - keys == set()
    assert named_envs - envs == set()
    assert {p for p in paths if not os.path.exists(os.path.join(REPO, p))} == set()


@pytest.mark.parametrize("name,pattern", sorted(PAGES.items()))
def test_every_example_file_is_documented(name, pattern):
    files = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, pattern)))
    assert files
    assert [f for f in files if f not in page(name)] == []


def _slurm_table() -> list[list[str]]:
    text = page("docs/slurm.md").split("## What comes from Slurm", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]
    assert rows
    return rows


def test_slurm_table_lists_what_the_code_sets():
    documented = {k for row in _slurm_table() for k in _KEY.findall(row[0])}
    env = {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_STEP_ID": "0"}
    got = slurm.slurm_defaults(env, slurm.SchedulerFacts(grace_time_s=30, kill_wait_s=30, preemptable=True))
    assert documented == set(got.values)


def test_slurm_table_names_the_variables_the_code_reads():
    with open(os.path.join(REPO, "agent", "slurm.py"), encoding="utf-8") as fh:
        source = fh.read()
    read = set(re.findall(r'"(SLURMD?_[A-Z_]+)"', source))
    documented = {v for row in _slurm_table() for v in re.findall(r"\b(SLURMD?_[A-Z_]+)\b", row[1] + row[2])}
    # SLURM_RESTART_COUNT is named to say what a requeue keeps (the job id); nothing needs to read it.
    assert read == documented - {"SLURM_RESTART_COUNT"}
