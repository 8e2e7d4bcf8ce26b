"""The ``trainguard`` command line.

``trainguard run`` accepts the torchrun flags users already know, so switching is one word:
``torchrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 train.py``
becomes ``trainguard run --nnodes 1:4 ...``. Flags override ``TRAINGUARD_*`` env vars, which override
the YAML file. ``trainguard agent`` is what systemd runs.

Every user error ends as one line ``trainguard: <what> (<YAML key> / <env var>): <fix>`` on stderr and
exit code 2, never a traceback (:class:`~trainguard.contract.configbase.ConfigError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from trainguard.agent import __version__
from trainguard.agent.config import TrainguardConfig
from trainguard.agent.configload import CONFIG_PATH_ENV, DEFAULT_CONFIG_PATH, load_config, redacted
from trainguard.contract import log as tglog
from trainguard.contract.configbase import ConfigError

log = tglog.get_logger("trainguard.agent.cli")

# torchrun --rdzv-conf keys -> our config keys
_RDZV_CONF = {
    "join_timeout": "rendezvous.join_timeout_s",
    "last_call_timeout": "rendezvous.last_call_timeout_s",
    "close_timeout": "rendezvous.close_timeout_s",
    "keep_alive_interval": "rendezvous.keep_alive_interval_s",
    "keep_alive_max_attempt": "rendezvous.keep_alive_max_attempts",
    "is_host": "rendezvous.is_host",
}
MAX_DRAIN_DEADLINE_S = 7 * 24 * 3600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_duration(text: str) -> float:
    """``30``, ``30s``, ``2m``, ``1h`` -> seconds (> 0, at most a week)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 30, 30s, 2m")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not 0 < seconds <= MAX_DRAIN_DEADLINE_S:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must be > 0 and at most a week")
    return seconds


def standalone_job_id(script: str, script_args: Sequence[str], *, module: bool = False) -> str:
    """A job id that is the same every time the same script runs with the same arguments, so a
    re-run of ``trainguard run --standalone ... train.py ARGS`` finds its own checkpoints:
    ``<script name>-<8 hex digits of a hash of its absolute path (or module name) and arguments>``."""
    target = script if module else os.path.abspath(script)
    digest = hashlib.sha256(json.dumps([target, list(script_args)]).encode()).hexdigest()[:8]
    stem = os.path.splitext(os.path.basename(script))[0] if not module else script.rsplit(".", 1)[-1]
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-._")[:40] or "job"
    return f"{stem}-{digest}"


def _add_override_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun-compatible flags (override YAML and env)")
    g.add_argument("--nnodes", help="MIN:MAX or N nodes (rendezvous.min_nodes/max_nodes)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", help="workers per node (workers.nproc_per_node)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", help="c10d | etcd | etcd-v2 (deprecated) | static (rendezvous.backend)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", help="HOST:PORT (rendezvous.endpoint)")
    g.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="job id shared by all nodes (agent.job_id)")
    g.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", help="k=v,... (join_timeout, last_call_timeout, close_timeout, keep_alive_interval, keep_alive_max_attempt, is_host)")
    g.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", help="restarts after failures (workers.max_restarts)")
    g.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval", help="seconds between worker polls")
    g.add_argument("--standalone", action="store_true",
                   help="single node: local c10d store on a free port; job id derived from the script and its "
                        "arguments when checkpoint.url is set (so a re-run resumes), else random")
    g.add_argument("--local-addr", "--local_addr", dest="local_addr", help="address other nodes reach this one at")
    g.add_argument("--log-dir", "--log_dir", dest="log_dir", help="per-rank worker logs (agent.log_dir)")
    g.add_argument("-m", "--module", action="store_true", default=None, help="run the entrypoint as a module (python -m)")
    g.add_argument("--no-python", "--no_python", dest="no_python", action="store_true", default=None, help="run the entrypoint as an executable")
    g.add_argument("--node-name", dest="node_name", help="this node's name in logs/metrics (agent.node_name)")
    g.add_argument("--state-dir", dest="state_dir", help="agent runtime state (agent.state_dir)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set checkpoint.url=s3://bucket/runs (repeatable; keys in "
                        "docs/configuration.md)")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags -> dotted config keys (the values stay strings; the loader parses them)."""
    o: dict[str, Any] = {}
    if args.nnodes:
        lo, _, hi = args.nnodes.partition(":")
        o["rendezvous.min_nodes"], o["rendezvous.max_nodes"] = lo, hi or lo
    simple = {
        "nproc_per_node": "workers.nproc_per_node", "rdzv_backend": "rendezvous.backend",
        "rdzv_endpoint": "rendezvous.endpoint", "rdzv_id": "agent.job_id", "max_restarts": "workers.max_restarts",
        "monitor_interval": "workers.monitor_interval_s", "local_addr": "rendezvous.local_addr",
        "log_dir": "agent.log_dir", "node_name": "agent.node_name", "state_dir": "agent.state_dir",
        "module": "workers.module", "no_python": "workers.no_python",
    }
    for attr, key in simple.items():
        v = getattr(args, attr, None)
        if v is not None:
            o[key] = v if not isinstance(v, bool) else str(v)
    if args.rdzv_conf:
        for item in filter(None, args.rdzv_conf.split(",")):
            k, _, v = item.partition("=")
            if k.strip() not in _RDZV_CONF:
                raise ConfigError("--rdzv-conf", f"unknown --rdzv-conf key {k.strip()!r}",
                                  f"use one of {sorted(_RDZV_CONF)}", source="command line", env_var="")
            o[_RDZV_CONF[k.strip()]] = v.strip()
    if args.standalone:
        o.update({"rendezvous.backend": "c10d", "rendezvous.endpoint": f"127.0.0.1:{_free_port()}",
                  "rendezvous.min_nodes": "1", "rendezvous.max_nodes": "1", "rendezvous.is_host": "true"})
    for item in args.sets:
        k, sep, v = item.partition("=")
        if not sep or "." not in k:
            raise ConfigError("--set", f"--set expects KEY=VALUE with a dotted key, got {k.strip() or item!r}",
                              "e.g. --set checkpoint.keep_last=3 (keys in docs/configuration.md)",
                              source="command line", env_var="")
        o[k.strip()] = v
    return o


def _config_path(args: argparse.Namespace, env: Mapping[str, str], required: bool) -> str | None:
    positional = getattr(args, "file", None)
    flag = getattr(args, "config", None)
    if positional and flag and positional != flag:
        raise ConfigError("--config", f"two config files given ({positional} and --config {flag})",
                          "give one: `trainguard config check FILE` and `--config FILE` mean the same",
                          env_var=CONFIG_PATH_ENV)
    path = positional or flag or env.get(CONFIG_PATH_ENV)
    if path:
        return path
    if required or os.path.exists(DEFAULT_CONFIG_PATH):
        return DEFAULT_CONFIG_PATH
    return None


def _user_defaults() -> dict[str, Any]:
    """``trainguard run`` keeps its logs under the per-user private base (checked at start) instead
    of ``/var/log``; the state dir has its own default (:mod:`trainguard.agent.rundir`)."""
    from trainguard.agent import rundir

    return {"agent.log_dir": os.path.join(rundir.private_base(), "logs")}


def _start(cfg: TrainguardConfig, env: Mapping[str, str], *, announce: bool, note: str = "") -> int:
    """Checks, start-up warnings, then the agent (see :mod:`trainguard.agent.preflight`)."""
    from trainguard.agent import prestart, preflight, rundir, torchlogs

    tglog.configure(cfg.agent.log_format, cfg.agent.log_level)
    torchlogs.install()
    preflight.check(cfg)
    if cfg.agent.log_dir.startswith(rundir.private_base() + os.sep):
        rundir.ensure_private_dir(cfg.agent.log_dir, key="agent.log_dir")
    prestart.start(cfg, os.environ)  # the workers' interpreters import torch beside the agent's import of it
    try:
        code = _run(cfg, env, announce=announce, note=note)
    finally:
        prestart.close("the agent stops")
    return _exit_now(code)


def _run(cfg: TrainguardConfig, env: Mapping[str, str], *, announce: bool, note: str) -> int:
    from trainguard.agent import preflight
    from trainguard.agent.daemon import run_agent
    from trainguard.contract.protocol import control_socket_path

    for w in preflight.warnings(cfg, env):
        log.warning(w.event, **w.fields)
    if not cfg.checkpoint.url:
        log.warning("checkpoint_url_unset", effect="worker-API scripts save no checkpoints: a drain or a crash loses "
                    "the work since the start", fix="set checkpoint.url (TRAINGUARD_CHECKPOINT_URL, or --set "
                    "checkpoint.url=...)")
    sock = control_socket_path(cfg.agent.state_dir, cfg.agent.job_id)
    drain = f"trainguard drain --socket {sock}"
    log.info("agent_control", job_id=cfg.agent.job_id, socket=sock, drain_command=drain)
    if note:
        print(f"trainguard: {note}", file=sys.stderr, flush=True)
    if announce:
        print(f"trainguard: job {cfg.agent.job_id}; drain it with `trainguard drain` "
              f"(or `{drain}`), status with `trainguard status`", file=sys.stderr, flush=True)
    return run_agent(cfg, env)


def _exit_now(code: int) -> int:
    """End the agent process as soon as :func:`run_agent` returned: every service is stopped, the
    control socket closed, ``agent_exit`` logged. The interpreter's own teardown (torch's native
    rendezvous and store objects) took another 2-3 s on this machine with no Python frame left to
    run, and an agent that lingers after ``agent_exit`` looks hung to its operator."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _slurm_defaults(env: Mapping[str, str]) -> Any:
    """Defaults from Slurm's environment under ``srun`` (:mod:`trainguard.agent.slurm`); empty outside."""
    from trainguard.agent import slurm

    return slurm.slurm_defaults(env, slurm.scontrol_facts(env) if env.get("SLURM_JOB_ID") else None)


def _slurm_note(sd: Any, cfg: TrainguardConfig) -> str:
    from trainguard.agent import slurm

    return slurm.describe(sd, slurm.effective(cfg, sd)) if sd.values else ""


def cmd_agent(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    sd = _slurm_defaults(env)
    cfg = load_config(_config_path(args, env, required=True), env, overrides_from_args(args), defaults=sd.values)
    return _start(cfg, env, announce=False, note=_slurm_note(sd, cfg))


def cmd_run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    o = overrides_from_args(args)
    o["workers.entrypoint"] = args.script
    o["workers.args"] = list(args.script_args)
    sd = _slurm_defaults(env)
    defaults = {**_user_defaults(), **sd.values}
    derived = note = ""
    if args.standalone:
        derived = standalone_job_id(args.script, args.script_args, module=bool(args.module))
        defaults["agent.job_id"] = derived  # below YAML, env and --rdzv-id: any of those wins
    cfg = load_config(_config_path(args, env, required=False), env, o, defaults=defaults)
    if derived and cfg.agent.job_id == derived:
        if cfg.checkpoint.url:
            note = (f"job id {derived} (from the script and its arguments: the same command resumes from its newest "
                    f"checkpoint under {cfg.checkpoint.url}; pass --rdzv-id to choose the id)")
        else:  # nothing to resume: a fresh id keeps concurrent runs of one script apart
            cfg.agent = dataclasses.replace(cfg.agent, job_id=uuid.uuid4().hex[:12])
    note = "; ".join(filter(None, [_slurm_note(sd, cfg), note]))
    return _start(cfg, env, announce=True, note=note)


def cmd_config_check(args: argparse.Namespace) -> int:
    from trainguard.agent import preflight

    path = _config_path(args, {}, required=False)
    if not path:
        raise ConfigError("--config", "no config file given", "trainguard config check FILE (or --config FILE)",
                          env_var=CONFIG_PATH_ENV)
    cfg = load_config(path, dict(os.environ) if args.env else {})
    preflight.check_url_shape(cfg.checkpoint.url)
    print(f"{path}: OK")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    cfg = load_config(_config_path(args, env, required=False), env, overrides_from_args(args))
    data = redacted(cfg)
    print(json.dumps(data, indent=2) if args.format == "json" else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _find_agent_socket(args: argparse.Namespace) -> str:
    """``--socket`` as given, else the one live agent found (and said so on stderr)."""
    from trainguard.agent import discover

    if args.socket:
        return str(args.socket)
    env = dict(os.environ)
    state_dir = args.state_dir
    if not state_dir and args.config:
        state_dir = load_config(args.config, env).agent.state_dir
    agent = discover.find_one(env, job_id=args.job_id, state_dir=state_dir)
    print(f"trainguard: found the agent of {agent.describe()}", file=sys.stderr)
    return agent.socket


def _ask(path: str, message: Any, timeout: float) -> Any:
    """One control request with every transport failure turned into a ConfigError naming the fix."""
    from trainguard.agent import control
    from trainguard.contract.protocol import ProtocolError

    try:
        return control.request(path, message, timeout=timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise ConfigError("--socket", f"no agent listening on {path}",
                          "is it running? Run without --socket to find the live one", env_var="") from None
    except PermissionError:
        raise ConfigError("--socket", f"permission denied on {path}",
                          "run as the agent's user (or root): the socket is private to it", env_var="") from None
    except TimeoutError:
        raise ConfigError("--socket", f"the agent at {path} did not answer within {timeout:g}s",
                          "it may be stuck: check its log (`journalctl -u trainguard-agent`), retry with "
                          "--timeout, or stop it", env_var="") from None
    except (OSError, ProtocolError) as e:
        raise ConfigError("--socket", f"cannot talk to the agent at {path}: {e}",
                          "check that the path is a trainguard agent's control socket", env_var="") from None


def cmd_drain(args: argparse.Namespace) -> int:
    """Ask the agent to drain; say so in words. ``--wait``: follow it until the node has left and say
    how it ended (exit 0 when its work is committed, 5 when the emergency checkpoint failed, 1 when it
    failed otherwise or did not leave within the deadline plus ``--timeout``)."""
    from trainguard.contract.protocol import DrainRequest

    path = _find_agent_socket(args)
    reply = _ask(path, DrainRequest(deadline_s=args.deadline, reason=args.reason or "trainguard drain"), args.timeout)
    if not reply.ok:
        print(f"trainguard: the agent refused the drain: {reply.error}", file=sys.stderr)
        return 1
    status = _ask(path, _status_request(), args.timeout).data
    who = f"job {status.get('job_id', '?')} on node {status.get('node', '?')}"
    if reply.data.get("already_draining"):
        print(f"trainguard: {who} is already draining")
    else:
        print(f"trainguard: drain of {who} requested: its workers checkpoint and it leaves the job "
              f"within {args.deadline:g} s" + ("" if args.wait else " (`trainguard drain --wait` follows it)"))
    if not args.wait:
        return 0
    return _follow_drain(path, status, give_up_at=time.monotonic() + args.deadline + args.timeout)


def _status_request() -> Any:
    from trainguard.contract.protocol import StatusRequest

    return StatusRequest()


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _follow_drain(path: str, status: dict[str, Any], *, give_up_at: float) -> int:
    """Poll the agent until its control socket is gone, printing each change; then its outcome."""
    from trainguard.agent.exitcodes import ExitCode, read_record

    pid, seen = status.get("pid"), ""
    while time.monotonic() < give_up_at:
        try:
            status = _ask(path, _status_request(), 2.0).data
        except ConfigError:  # gone (or not answering): the record or the missing socket says it has exited
            if read_record(path, pid if isinstance(pid, int) else None) is not None or not os.path.exists(path):
                break
            time.sleep(0.25)
            continue
        step = status.get("emergency_step")
        now = f"{status.get('state')}" + (f", emergency checkpoint of step {step} committed" if step is not None else "")
        if now != seen:
            print(f"trainguard: {now}", flush=True)
            seen = now
        time.sleep(0.25)
    else:
        print(f"trainguard: the agent (pid {pid}) has not left yet; it may be stuck: check its log", file=sys.stderr)
        return 1
    if isinstance(pid, int):  # the agent process itself (a final metrics scrape may keep it a few seconds)
        from trainguard.metrics.agent import FINAL_SCRAPE_MAX_WAIT_S

        end = time.monotonic() + FINAL_SCRAPE_MAX_WAIT_S + 5.0
        while _pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.1)
    rec = read_record(path, pid if isinstance(pid, int) else None)
    if rec is None:
        print("trainguard: the agent has exited without saying how (killed?); check its log", file=sys.stderr)
        return 1
    code = ExitCode(rec["exit_code"])
    where = f"job {rec.get('job_id')} on node {rec.get('node')}"
    if code in (ExitCode.DRAINED, ExitCode.STOPPED):
        step = rec.get("emergency_step")
        saved = f"emergency checkpoint of step {step} committed" if step is not None else "nothing to checkpoint"
        print(f"trainguard: {where} left the job: {code.label} (agent exit code {int(code)}); {saved}")
        return 0
    print(f"trainguard: {where} ended: {code.label} (agent exit code {int(code)})"
          + (f"; the emergency checkpoint failed: {rec['error']}" if rec.get("error") else ""), file=sys.stderr)
    return int(code) if code is ExitCode.WORK_LOST else 1


def cmd_status(args: argparse.Namespace) -> int:
    from trainguard.contract.protocol import StatusRequest
    from trainguard.metrics.status import status

    if args.url:
        return status(args.url, timeout_s=args.timeout)
    path = _find_agent_socket(args)
    reply = _ask(path, StatusRequest(), args.timeout)
    if not reply.ok:
        print(f"trainguard: the agent answered: {reply.error}", file=sys.stderr)
        return 1
    data = reply.data
    url = data.get("metrics_url")
    if url and not data.get("waiting_for"):
        code = status(str(url), timeout_s=args.timeout)
        if data.get("job"):
            from trainguard.agent.census import format_job

            print(format_job(data["job"]), end="")
        return code
    # metrics.enabled is false: what the agent itself says
    for k in ("job_id", "node", "state", "waiting_for", "world_size", "nodes", "round", "remaining_restarts",
              "draining"):
        print(f"{k.replace('_', ' '):<18}{data.get(k, '-')}")
    return 0


def _add_agent_lookup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="agent control socket (default: the one live agent on this node)")
    p.add_argument("--job-id", dest="job_id", help="pick the agent of this job when several run")
    p.add_argument("--state-dir", dest="state_dir", help="look for agents only in this directory (agent.state_dir)")
    p.add_argument("--config", help="YAML config whose agent.state_dir to search")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent (default 5)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard", description="Fault-tolerant elastic training agent for PyTorch.")
    p.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("agent", help="run the node agent (what systemd runs)",
                       description="Run the node agent with the YAML config, env overrides and flags.")
    a.add_argument("--config", help=f"YAML config (default: ${CONFIG_PATH_ENV} or {DEFAULT_CONFIG_PATH})")
    _add_override_flags(a)
    a.set_defaults(func=cmd_agent)

    r = sub.add_parser("run", help="run a training script in the foreground (torchrun-compatible flags)",
                       description="Supervise SCRIPT like torchrun would, with trainguard's preemption handling.")
    r.add_argument("--config", help="optional YAML config")
    _add_override_flags(r)
    r.add_argument("script", help="training script (or module with -m, executable with --no-python)")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("config", help="validate or show configuration")
    csub = c.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    cc = csub.add_parser("check", help="validate a YAML config file (FILE or --config FILE)")
    cc.add_argument("file", nargs="?", help="the YAML file")
    cc.add_argument("--config", help="the YAML file (same as FILE)")
    cc.add_argument("--env", action="store_true", help="also apply TRAINGUARD_* env overrides")
    cc.set_defaults(func=cmd_config_check)
    cs = csub.add_parser("show", help="print the effective config, secrets redacted (FILE or --config FILE)")
    cs.add_argument("file", nargs="?", help="the YAML file")
    cs.add_argument("--config", help="the YAML file (same as FILE)")
    cs.add_argument("--format", choices=["yaml", "json"], default="yaml")
    _add_override_flags(cs)
    cs.set_defaults(func=cmd_config_show)

    d = sub.add_parser("drain", help="ask the local agent to checkpoint and leave the job")
    d.add_argument("--deadline", type=parse_duration, default=30.0, help="time until the node must be gone (30s, 2m)")
    d.add_argument("--reason", default="manual drain")
    d.add_argument("--wait", action="store_true",
                   help="block until the emergency checkpoint is committed and the node has left; print the outcome "
                        "(exit 0: work committed, 5: the checkpoint failed, 1: failed or still there after "
                        "--deadline + --timeout)")
    _add_agent_lookup(d)
    d.set_defaults(func=cmd_drain)

    st = sub.add_parser("status", help="this node's live view (from its agent's /metrics)",
                        description="Print the live view of the agent on this node, read from its /metrics "
                                    "endpoint (found through its control socket, or --url).")
    st.add_argument("--url", help="read this exporter directly, e.g. http://127.0.0.1:9400")
    _add_agent_lookup(st)
    st.set_defaults(func=cmd_status)

    for modname in ("trainguard.checkpoint.cli", "trainguard.agent.store"):
        try:
            mod = __import__(modname, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue
        if hasattr(mod, "register"):
            mod.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # The one place the process environment is handed on (sd_notify in `trainguard store`).
    args.environ = os.environ
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"trainguard: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainguard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
