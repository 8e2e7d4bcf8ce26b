"""Config loading: bad input names the YAML key, the env var and the fix; precedence yaml < env < CLI."""

import json
import os

import pytest

from trainguard.agent.cli import build_parser, overrides_from_args
from trainguard.runtime.configbase import ConfigError, env_var_for
from trainguard.agent.configload import all_keys, load_config, redacted

SNAPSHOT = os.path.join(os.path.dirname(__file__), "snapshots", "config_keys.json")


def write(tmp_path, text):
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return str(p)


BAD = [
    # (yaml text, env, key named in the error, fragment of the message)
    ("rendezvous:\n  min_nodes: 3\n  max_nodes: 2\n", {}, "rendezvous.max_nodes", "must be >= min_nodes"),
    ("rendezvous:\n  min_nodes: 0\n", {}, "rendezvous.min_nodes", "must be >= 1"),
    ("rendezvous:\n  backend: zookeeper\n", {}, "rendezvous.backend", "must be one of"),
    ("rendezvous:\n  endpoint: nohostport\n", {}, "rendezvous.endpoint", "host:port"),
    ("rendezvous:\n  keep_alive_max_attempts: 1\n", {}, "rendezvous.keep_alive_max_attempts", ">= 2"),
    ("workers:\n  nproc_per_node: two\n", {}, "workers.nproc_per_node", "expected int"),
    ("workers:\n  nproc_per_node: 0\n", {}, "workers.nproc_per_node", "must be >= 1"),
    ("workers:\n  max_restarts: -1\n", {}, "workers.max_restarts", "must be >= 0"),
    ("workers:\n  module: true\n  no_python: true\n", {}, "workers.module", "mutually exclusive"),
    ("workers:\n  tee: maybe\n", {}, "workers.tee", "expected bool"),
    ("workers:\n  args: train.py\n", {}, "workers.args", "expected list"),
    ("checkpoint:\n  keep_last: 1\n", {}, "checkpoint.keep_last", ">= 2"),
    ("checkpoint:\n  url: ftp://host/x\n", {}, "checkpoint.url", "unsupported scheme"),
    ("checkpoint:\n  keep_lats: 3\n", {}, "checkpoint.keep_lats", "did you mean `checkpoint.keep_last`"),
    ("chekpoint:\n  url: /x\n", {}, "chekpoint", "unknown section"),
    ("preemption:\n  sources: [aws, oracle]\n", {}, "preemption.sources", "unknown source"),
    ("metrics:\n  port: 70000\n", {}, "metrics.port", "0..65535"),
    ("cost:\n  capacity: reserved\n", {}, "cost.capacity", "spot"),
    ("agent:\n  log_format: xml\n", {}, "agent.log_format", "must be one of"),
    ("", {"TRAINGUARD_RENDEZVOUS_MIN_NODES": "x"}, "rendezvous.min_nodes", "expected int"),
    ("", {"TRAINGUARD_RENDEZVOUS_MIN_NODE": "2"}, "rendezvous.min_nodes", "unknown environment variable"),
    ("", {"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": "{not json"}, "checkpoint.storage_options", "not a JSON object"),
]


@pytest.mark.parametrize("text,env,key,fragment", BAD, ids=[b[2] + ":" + b[3][:20] for b in BAD])
def test_bad_config_names_key_env_and_fix(tmp_path, text, env, key, fragment):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text), env)
    msg = str(ei.value)
    assert ei.value.key == key
    assert f"`{key}`" in msg
    assert env_var_for(key) in msg, msg
    assert "Fix:" in msg
    assert fragment in msg


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"), {})
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_config(write(tmp_path, "agent:\n  job_id: [unclosed\n"), {})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), {})


def test_precedence_defaults_yaml_env_cli(tmp_path):
    path = write(tmp_path, "agent:\n  job_id: from-yaml\nworkers:\n  nproc_per_node: 2\n  max_restarts: 5\n")
    cfg = load_config(path, {})
    assert (cfg.agent.job_id, cfg.workers.nproc_per_node, cfg.workers.max_restarts) == ("from-yaml", 2, 5)
    assert cfg.rendezvous.backend == "c10d"  # default
    env = {"TRAINGUARD_AGENT_JOB_ID": "from-env", "TRAINGUARD_WORKERS_NPROC_PER_NODE": "4"}
    cfg = load_config(path, env)
    assert (cfg.agent.job_id, cfg.workers.nproc_per_node, cfg.workers.max_restarts) == ("from-env", 4, 5)
    args = build_parser().parse_args(["run", "--rdzv-id", "from-cli", "--nnodes", "2:4", "train.py", "--lr", "1"])
    cfg = load_config(path, env, overrides_from_args(args))
    assert cfg.agent.job_id == "from-cli"
    assert cfg.workers.nproc_per_node == 4  # env, not overridden on the command line
    assert (cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes) == (2, 4)
    assert args.script == "train.py" and args.script_args == ["--lr", "1"]


def test_env_types_and_unrelated_vars_ignored():
    env = {"TRAINGUARD_WORKERS_TEE": "false", "TRAINGUARD_WORKERS_ARGS": "--a,1", "TRAINGUARD_RENDEZVOUS_IS_HOST": "true",
           "TRAINGUARD_PREEMPTION_SOURCES": '["aws","signal"]', "TRAINGUARD_RT_CONTROL": "/x", "HOME": "/root"}
    cfg = load_config(None, env)
    assert cfg.workers.tee is False and cfg.workers.args == ["--a", "1"]
    assert cfg.rendezvous.is_host is True and cfg.preemption.sources == ["aws", "signal"]


def test_rdzv_conf_and_standalone_flags():
    args = build_parser().parse_args(["run", "--rdzv-conf", "join_timeout=30,is_host=false", "--standalone", "x.py"])
    cfg = load_config(None, {}, overrides_from_args(args))
    assert cfg.rendezvous.join_timeout_s == 30.0 and cfg.rendezvous.min_nodes == cfg.rendezvous.max_nodes == 1
    with pytest.raises(ConfigError, match="unknown --rdzv-conf key"):
        overrides_from_args(build_parser().parse_args(["run", "--rdzv-conf", "bogus=1", "x.py"]))


def test_secrets_redacted():
    env = {"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": json.dumps(
        {"key": "AKIA", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://x", "aws_secret_access_key": "zz"}})}
    out = json.dumps(redacted(load_config(None, env)))
    assert "s3cr3t" not in out and "zz" not in out and "http://x" in out


def test_config_keys_snapshot():
    """Renaming or removing a key is a deliberate change: update the snapshot and the README."""
    keys = {k: env_var_for(k) for k in all_keys()}
    if os.environ.get("TG_UPDATE_SNAPSHOTS") == "1":
        os.makedirs(os.path.dirname(SNAPSHOT), exist_ok=True)
        with open(SNAPSHOT, "w") as fh:
            json.dump(keys, fh, indent=1, sort_keys=True)
    with open(SNAPSHOT) as fh:
        assert keys == json.load(fh)
