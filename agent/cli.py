"""The ``trainguard`` command line.

``trainguard run`` accepts the torchrun flags users already know, so switching is one word:
``torchrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 train.py``
becomes ``trainguard run --nnodes 1:4 ...``. Flags override ``TRAINGUARD_*`` env vars, which override
the YAML file. ``trainguard agent`` is what systemd runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import yaml

from trainguard.agent import __version__
from trainguard.runtime import log as tglog
from trainguard.runtime.configbase import ConfigError
from trainguard.agent.configload import CONFIG_PATH_ENV, DEFAULT_CONFIG_PATH, load_config, redacted

# torchrun --rdzv-conf keys -> our config keys
_RDZV_CONF = {
    "join_timeout": "rendezvous.join_timeout_s",
    "last_call_timeout": "rendezvous.last_call_timeout_s",
    "close_timeout": "rendezvous.close_timeout_s",
    "keep_alive_interval": "rendezvous.keep_alive_interval_s",
    "keep_alive_max_attempt": "rendezvous.keep_alive_max_attempts",
    "is_host": "rendezvous.is_host",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_duration(text: str) -> float:
    """``30``, ``30s``, ``2m``, ``1h`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 30, 30s, 2m")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


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
    g.add_argument("--standalone", action="store_true", help="single node: local c10d store on a free port, random job id")
    g.add_argument("--local-addr", "--local_addr", dest="local_addr", help="address other nodes reach this one at")
    g.add_argument("--log-dir", "--log_dir", dest="log_dir", help="per-rank worker logs (agent.log_dir)")
    g.add_argument("-m", "--module", action="store_true", default=None, help="run the entrypoint as a module (python -m)")
    g.add_argument("--no-python", "--no_python", dest="no_python", action="store_true", default=None, help="run the entrypoint as an executable")
    g.add_argument("--node-name", dest="node_name", help="this node's name in logs/metrics (agent.node_name)")
    g.add_argument("--state-dir", dest="state_dir", help="agent runtime state (agent.state_dir)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set checkpoint.url=s3://bucket/runs (repeatable)")


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
                raise ConfigError("rendezvous", f"unknown --rdzv-conf key {k.strip()!r}",
                                  f"use one of {sorted(_RDZV_CONF)}", source="command line")
            o[_RDZV_CONF[k.strip()]] = v.strip()
    if args.standalone:
        o.update({"rendezvous.backend": "c10d", "rendezvous.endpoint": f"127.0.0.1:{_free_port()}",
                  "rendezvous.min_nodes": "1", "rendezvous.max_nodes": "1", "rendezvous.is_host": "true"})
        o.setdefault("agent.job_id", uuid.uuid4().hex[:12])
    for item in args.sets:
        k, sep, v = item.partition("=")
        if not sep or "." not in k:
            raise ConfigError(k or "?", f"--set expects KEY=VALUE with a dotted key, got {item!r}",
                              "e.g. --set checkpoint.keep_last=3", source="command line")
        o[k.strip()] = v
    return o


def _config_path(args: argparse.Namespace, env: dict[str, str], required: bool) -> str | None:
    path = getattr(args, "config", None) or env.get(CONFIG_PATH_ENV)
    if path:
        return path
    if required or os.path.exists(DEFAULT_CONFIG_PATH):
        return DEFAULT_CONFIG_PATH
    return None


def _user_defaults() -> dict[str, Any]:
    base = os.path.join(tempfile.gettempdir(), f"trainguard-{os.getuid()}")
    return {"agent.state_dir": os.path.join(base, "state"), "agent.log_dir": os.path.join(base, "logs")}


def cmd_agent(args: argparse.Namespace) -> int:
    from trainguard.agent.daemon import run_agent

    env = dict(os.environ)
    cfg = load_config(_config_path(args, env, required=True), env, overrides_from_args(args))
    tglog.configure(cfg.agent.log_format, cfg.agent.log_level)
    return run_agent(cfg, env)


def cmd_run(args: argparse.Namespace) -> int:
    from trainguard.agent.daemon import run_agent

    env = dict(os.environ)
    o = overrides_from_args(args)
    o["workers.entrypoint"] = args.script
    o["workers.args"] = list(args.script_args)
    cfg = load_config(_config_path(args, env, required=False), env, o, defaults=_user_defaults())
    tglog.configure(cfg.agent.log_format, cfg.agent.log_level)
    return run_agent(cfg, env)


def cmd_config_check(args: argparse.Namespace) -> int:
    load_config(args.file, dict(os.environ) if args.env else {})
    print(f"{args.file}: OK")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    cfg = load_config(_config_path(args, env, required=False), env, overrides_from_args(args))
    data = redacted(cfg)
    print(json.dumps(data, indent=2) if args.format == "json" else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from trainguard.agent import control
    from trainguard.runtime.protocol import DrainRequest, control_socket_path

    path = args.socket
    if not path:
        env = dict(os.environ)
        cfg = load_config(_config_path(args, env, required=False), env, {}, defaults=None if args.config else _user_defaults())
        path = control_socket_path(cfg.agent.state_dir, cfg.agent.job_id)
    try:
        reply = control.request(path, DrainRequest(deadline_s=args.deadline, reason=args.reason or "trainguard drain"))
    except (FileNotFoundError, ConnectionRefusedError):
        print(f"trainguard drain: no agent listening on {path}; is it running? (pass --socket or --config)", file=sys.stderr)
        return 2
    print(json.dumps(reply.to_dict()))
    return 0 if reply.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard", description="Fault-tolerant elastic training agent for PyTorch.")
    p.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("agent", help="run the node agent (what systemd runs)", description=cmd_agent.__doc__ or
                       "Run the node agent with the YAML config, env overrides and flags.")
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
    cc = csub.add_parser("check", help="validate a YAML config file")
    cc.add_argument("file")
    cc.add_argument("--env", action="store_true", help="also apply TRAINGUARD_* env overrides")
    cc.set_defaults(func=cmd_config_check)
    cs = csub.add_parser("show", help="print the effective config (secrets redacted)")
    cs.add_argument("--config", help="YAML config")
    cs.add_argument("--format", choices=["yaml", "json"], default="yaml")
    _add_override_flags(cs)
    cs.set_defaults(func=cmd_config_show)

    d = sub.add_parser("drain", help="ask the local agent to checkpoint and leave the job")
    d.add_argument("--deadline", type=parse_duration, default=30.0, help="time until the node must be gone (30s, 2m)")
    d.add_argument("--reason", default="manual drain")
    d.add_argument("--socket", help="agent control socket (default: from the config)")
    d.add_argument("--config", help="YAML config used to find the socket")
    d.set_defaults(func=cmd_drain)

    for modname in ("trainguard.metrics.status", "trainguard.checkpoint.cli", "trainguard.agent.store"):
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


if __name__ == "__main__":
    sys.exit(main())
