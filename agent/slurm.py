"""Config defaults from Slurm's environment, for ``trainguard run`` / ``agent`` under ``srun``.

Under ``srun --ntasks-per-node=1 trainguard run train.py`` every agent already knows, from the
variables slurmstepd exports, what torchrun users otherwise type on each node:

=================================  ======================================================================
config key                         Slurm source
=================================  ======================================================================
``agent.job_id``                   ``slurm-$SLURM_JOB_ID`` (array tasks: ``slurm-<array id>_<task id>``);
                                   a requeued job keeps its id (``SLURM_RESTART_COUNT`` counts requeues),
                                   so it finds and resumes its own checkpoints
``agent.node_name``                ``SLURMD_NODENAME``
``rendezvous.min_nodes``/``max``   ``SLURM_JOB_NUM_NODES`` (``--nnodes MIN:MAX`` asks for elasticity)
``rendezvous.endpoint``            the first host of ``SLURM_JOB_NODELIST`` (:func:`expand_hostlist`) and
                                   port ``15000 + the last 4 digits of SLURM_JOB_ID`` (Lightning's rule,
                                   so two jobs that share a first node do not share a port)
``workers.nproc_per_node``         ``SLURM_GPUS_ON_NODE`` when Slurm allocated GPUs
``preemption.sigusr1``             on: ``#SBATCH --signal=USR1@<s>`` and ``scancel --signal=USR1`` drain
``preemption.signal_deadline_s``   the shorter of the partition's ``GraceTime`` (when the job can be
                                   preempted) and ``KillWait`` (the SIGTERM -> SIGKILL gap of ``scancel``
                                   and time limits): a SIGTERM does not say which it is. Read with
                                   ``scontrol`` (:func:`scontrol_facts`), left alone without it
=================================  ======================================================================

These are *defaults*: the YAML file, ``TRAINGUARD_*`` variables and flags all win over them
(:func:`trainguard.agent.configload.load_config` ``defaults=``). :func:`slurm_defaults` is pure (a
mapping in, values and their origins out) and table-tested; :func:`describe` is the one line the CLI
prints to say what came from where. Only :func:`scontrol_facts` runs a command.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.contract.configbase import ConfigError

PORT_BASE = 15000
"""Rendezvous port = ``PORT_BASE`` + the last four digits of the job id (at most 24999)."""
SCONTROL_TIMEOUT_S = 5.0
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    """A Slurm hostlist expression that cannot be expanded."""


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unmatched ']' in hostlist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unclosed '[' in hostlist {text!r}")
    parts.append("".join(cur))
    return parts


def _expand_range(body: str, text: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise HostlistError(f"bad range {item!r} in hostlist {text!r} (expected N or N-M)")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {item!r} in hostlist {text!r}")
        width = len(lo)  # Slurm pads to the width of the first bound: [009-011], [8-10]
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist (``SLURM_JOB_NODELIST``) the way ``scontrol show hostnames`` does.

    ``gpu[01-03,7],login`` -> ``gpu01 gpu02 gpu03 gpu7 login``; several bracket groups in one name
    expand as a product, left one outermost (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``). Raises
    :class:`HostlistError` on malformed input.
    """
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        part = part.strip()
        if not part:
            continue
        names = [""]
        for chunk in re.split(r"(\[[^\]]*\])", part):
            if chunk.startswith("["):
                options = _expand_range(chunk[1:-1], text)
            else:
                options = [chunk]
            names = [n + o for n in names for o in options]
        hosts += names
    if not hosts:
        raise HostlistError(f"empty hostlist {text!r}")
    return hosts


@dataclass(frozen=True, slots=True)
class SchedulerFacts:
    """What ``scontrol`` says about the job's partition (seconds; 0 = unknown or none)."""

    grace_time_s: int = 0
    """The partition's ``GraceTime``: SIGTERM at preemption, SIGKILL this much later."""
    kill_wait_s: int = 0
    """``KillWait``: SIGTERM at ``scancel`` or the time limit, SIGKILL this much later."""
    preemptable: bool = False
    """The partition's ``PreemptMode`` is not ``OFF``."""


@dataclass(frozen=True, slots=True)
class SlurmDefaults:
    """Config defaults taken from Slurm: ``values`` (dotted key -> text) and where each came from."""

    values: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    """Dotted key -> the variable(s) or command it came from, e.g. ``"SLURM_JOB_ID"``."""
    notes: tuple[str, ...] = ()
    """What was left alone, and why (printed with the line)."""


def job_id(env: Mapping[str, str]) -> str:
    """``slurm-<id>``: ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID`` for array tasks, else ``SLURM_JOB_ID``."""
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"slurm-{array}_{task}" if array and task else f"slurm-{env['SLURM_JOB_ID']}"


def rendezvous_port(slurm_job_id: str) -> int:
    """``PORT_BASE`` + the last four digits of ``SLURM_JOB_ID`` (unique per array task too)."""
    digits = re.sub(r"\D", "", slurm_job_id)[-4:]
    return PORT_BASE + int(digits or 0)


def slurm_defaults(env: Mapping[str, str], facts: SchedulerFacts | None = None) -> SlurmDefaults:
    """Pure: the config defaults Slurm's environment implies (empty outside a Slurm job).

    Raises :class:`~trainguard.contract.configbase.ConfigError` naming the Slurm variable and the key
    it feeds when a value is malformed (the fix: set that key yourself).
    """
    if not env.get("SLURM_JOB_ID"):
        return SlurmDefaults()
    values: dict[str, str] = {}
    origins: dict[str, str] = {}

    def put(key: str, value: object, origin: str) -> None:
        values[key], origins[key] = str(value), origin

    array = bool(env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"))
    jid = job_id(env)
    put("agent.job_id", jid, "SLURM_ARRAY_JOB_ID+SLURM_ARRAY_TASK_ID" if array else "SLURM_JOB_ID")
    if env.get("SLURMD_NODENAME"):
        put("agent.node_name", env["SLURMD_NODENAME"], "SLURMD_NODENAME")
    notes: list[str] = []
    nodes_var = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
    nodes = 0
    if env.get(nodes_var):
        text = env[nodes_var]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError("rendezvous.min_nodes", f"{nodes_var}={text!r} is not a node count",
                              "pass --nnodes (or set rendezvous.min_nodes/max_nodes), or run under srun",
                              source=f"env {nodes_var}")
        nodes = int(text)
    # The batch script (or an salloc shell) has no SLURM_STEP_ID and runs on the first node only: an agent
    # started there is one node, whatever the allocation holds; waiting for the others would hang.
    in_step = bool(env.get("SLURM_STEP_ID"))
    if nodes > 1 and not in_step:
        notes.append(f"not in a job step, so the node count ({nodes_var}={nodes}) and the endpoint are left "
                     "alone: start one agent per node with `srun --ntasks-per-node=1 trainguard run ...`")
    elif nodes:
        put("rendezvous.min_nodes", nodes, nodes_var)
        put("rendezvous.max_nodes", nodes, nodes_var)
    nodelist_var = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    if env.get(nodelist_var) and (in_step or nodes <= 1):
        try:
            first = expand_hostlist(env[nodelist_var])[0]
        except HostlistError as e:
            raise ConfigError("rendezvous.endpoint", f"{nodelist_var} cannot be expanded: {e}",
                              "pass --rdzv-endpoint HOST:PORT (or set rendezvous.endpoint)",
                              source=f"env {nodelist_var}") from None
        port = rendezvous_port(env["SLURM_JOB_ID"])
        put("rendezvous.endpoint", f"{first}:{port}", f"first host of {nodelist_var}")
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        put("workers.nproc_per_node", gpus, "SLURM_GPUS_ON_NODE")
    put("preemption.sigusr1", "true", "Slurm job (--signal=USR1@s, scancel --signal=USR1)")
    if facts is not None:
        # A SIGTERM does not say whether it is a preemption (SIGKILL-worthy at GraceTime) or a scancel or
        # time limit (SIGKILL after KillWait): plan for the shorter window of the two that apply.
        windows = {"partition GraceTime (scontrol)": facts.grace_time_s if facts.preemptable else 0,
                   "KillWait (scontrol)": facts.kill_wait_s}
        known = {origin: s for origin, s in windows.items() if s > 0}
        if known:
            origin = min(known, key=lambda o: known[o])
            put("preemption.signal_deadline_s", known[origin], origin)
    return SlurmDefaults(values, origins, tuple(notes))


def describe(defaults: SlurmDefaults, effective: Mapping[str, str]) -> str:
    """The one line the CLI prints: each key Slurm set and its source, and the keys where the YAML,
    an env var or a flag won (``effective``: dotted key -> the value the loaded config has, as text)."""
    used = [f"{k}={v} ({defaults.origins[k]})" for k, v in defaults.values.items() if effective.get(k) == v]
    kept = [k for k, v in defaults.values.items() if effective.get(k) != v]
    line = "from Slurm: " + ", ".join(used or ["nothing"])
    if kept:
        line += "; set elsewhere (YAML, TRAINGUARD_* or a flag): " + ", ".join(kept)
    return "; ".join([line, *defaults.notes])


def effective(cfg: Any, defaults: SlurmDefaults) -> dict[str, str]:
    """The loaded config's values of the keys in ``defaults``, as text comparable with them."""
    out = {}
    for key in defaults.values:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        out[key] = str(value).lower() if isinstance(value, bool) else (
            f"{value:g}" if isinstance(value, float) else str(value))
    return out


def _seconds(text: str) -> int:
    m = re.match(r"\s*(\d+)", text)
    return int(m.group(1)) if m else 0


def parse_scontrol(partition_line: str, config_text: str) -> SchedulerFacts:
    """Pure: :class:`SchedulerFacts` from ``scontrol -o show partition P`` and ``scontrol show config``."""
    fields = dict(kv.split("=", 1) for kv in partition_line.split() if "=" in kv)
    kill_wait = 0
    for line in config_text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            kill_wait = _seconds(value)
    mode = fields.get("PreemptMode", "OFF").upper()
    return SchedulerFacts(grace_time_s=_seconds(fields.get("GraceTime", "0")), kill_wait_s=kill_wait,
                          preemptable=not mode.startswith("OFF"))


def scontrol_facts(env: Mapping[str, str]) -> SchedulerFacts | None:
    """Ask ``scontrol`` for the job partition's GraceTime and the cluster's KillWait; None when
    ``scontrol`` is missing, fails or is slow (the defaults then leave the deadline alone)."""
    binary = shutil.which("scontrol")
    partition = env.get("SLURM_JOB_PARTITION", "")
    if not binary or not partition:
        return None
    try:
        part = subprocess.run([binary, "-o", "show", "partition", partition], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, env=dict(env), check=True).stdout
        conf = subprocess.run([binary, "show", "config"], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, env=dict(env), check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_scontrol(part, conf)
