"""Config loading: bad input names the YAML key, the env var and the fix; precedence yaml < env < CLI."""

import json
import os

import pytest

from trainguard.agent.cli import build_parser, overrides_from_args
from trainguard.agent.configload import all_keys, load_config, redacted
from trainguard.contract.configbase import ConfigError, env_var_for

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
    ("rendezvous:\n  protocol: gossip\n", {}, "rendezvous.protocol", "must be one of"),
    ("rendezvous:\n  protocol: keyed\n  backend: etcd-v2\n  endpoint: 127.0.0.1:2379\n", {}, "rendezvous.protocol",
     "c10d or etcd"),
    ("", {"TRAINGUARD_RENDEZVOUS_PROTOCOL": "Keyed"}, "rendezvous.protocol", "must be one of"),
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
    ("checkpoint:\n  keep_lats: 3\n", {}, "checkpoint.keep_last", "did you mean `checkpoint.keep_last`"),
    ("preemption:\n  sources: [aws, oracle]\n", {}, "preemption.sources", "unknown source"),
    ("metrics:\n  port: 70000\n", {}, "metrics.port", "0..65535"),
    ("cost:\n  capacity: reserved\n", {}, "cost.capacity", "spot"),
    ("agent:\n  log_format: xml\n", {}, "agent.log_format", "must be one of"),
    ("", {"TRAINGUARD_RENDEZVOUS_MIN_NODES": "x"}, "rendezvous.min_nodes", "expected int"),
    ("", {"TRAINGUARD_RENDEZVOUS_MIN_NODE": "2"}, "rendezvous.min_nodes", "unknown environment variable"),
    ("", {"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": "{not json"}, "checkpoint.storage_options", "not a JSON object"),
    ("rendezvous:\n  last_call_timeout_s: 0\n", {}, "rendezvous.last_call_timeout_s", "must be > 0"),
    ("rendezvous:\n  close_timeout_s: -5\n", {}, "rendezvous.close_timeout_s", "must be > 0"),
    ("rendezvous:\n  join_timeout_s: .inf\n", {}, "rendezvous.join_timeout_s", "finite"),
    ("rendezvous:\n  join_timeout_s: 1.0e+9\n", {}, "rendezvous.join_timeout_s", "at most"),
    ("", {"TRAINGUARD_RENDEZVOUS_JOIN_TIMEOUT_S": "nan"}, "rendezvous.join_timeout_s", "finite"),
    ("workers:\n  exit_barrier_timeout_s: -1\n", {}, "workers.exit_barrier_timeout_s", "must be > 0"),
    ("workers:\n  pg_timeout_s: 1\n", {}, "workers.pg_timeout_s", "10..86400"),
    ("workers:\n  env:\n    A: [1, 2]\n", {}, "workers.env", "values must be strings"),
    ("agent:\n  job_id: '..'\n", {}, "agent.job_id", "starting with a letter or digit"),
    ("agent:\n  job_id: a/b\n", {}, "agent.job_id", "letters, digits"),
    ("preemption:\n  term_grace_s: .nan\n", {}, "preemption.term_grace_s", "finite"),
    ("preemption:\n  drain_lead_s: soon\n", {}, "preemption.drain_lead_s", "must be auto or seconds"),
    ("preemption:\n  drain_lead_s: 0\n", {}, "preemption.drain_lead_s", "must be auto or seconds"),
    ("", {"TRAINGUARD_PREEMPTION_DRAIN_LEAD_S": "nan"}, "preemption.drain_lead_s", "must be auto or seconds"),
    ("preemption:\n  drain_lead_factor: 0.5\n", {}, "preemption.drain_lead_factor", "within [1, 100]"),
]


@pytest.mark.parametrize("text,env,key,fragment", BAD, ids=[b[2] + ":" + b[3][:20] for b in BAD])
def test_bad_config_names_key_env_and_fix(tmp_path, text, env, key, fragment):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text), env)
    msg = str(ei.value)
    assert ei.value.key == key
    # `<what> (<YAML key> / <env var>): <fix>`
    what, _, fix = msg.partition(f" ({key} / {env_var_for(key)}): ")
    assert what and fix, msg
    assert fragment in msg


def test_unknown_section_and_env_suggest_the_real_names(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, "chekpoint:\n  url: /x\n"), {})
    assert "unknown section `chekpoint`" in str(ei.value) and "did you mean `checkpoint`" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"TRAINGUARD_RENDEZVOUS_MIN_NODE": "2"})
    assert "(rendezvous.min_nodes / TRAINGUARD_RENDEZVOUS_MIN_NODES): did you mean TRAINGUARD_RENDEZVOUS_MIN_NODES" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, {}, {"checkpoint.keep_lst": "3"})
    msg = str(ei.value)
    assert msg.startswith("unknown config key `checkpoint.keep_lst` in the command line ")
    assert "(checkpoint.keep_last / TRAINGUARD_CHECKPOINT_KEEP_LAST)" in msg and "KEEP_LST" not in msg
    assert "docs/configuration.md" in msg


def test_duplicate_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"duplicate key 'min_nodes' \(first at line 2\)"):
        load_config(write(tmp_path, "rendezvous:\n  min_nodes: 1\n  min_nodes: 2\n"), {})


def test_errors_never_echo_secret_values(tmp_path):
    secret = "sk-CANARY-1234"
    cases = [
        ({"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": f'{{"key": "{secret}", '}, None),
        ({"TRAINGUARD_WORKERS_ENV": f'{{"WANDB_API_KEY": ["{secret}"]}}'}, None),
        ({}, f"workers:\n  args: {secret}\n"),
        ({}, f"checkpoint:\n  storage_options: {secret}\n"),
    ]
    for env, text in cases:
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, text) if text else None, env)
        assert secret not in str(ei.value), str(ei.value)


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


def test_drain_lead_auto_by_default_or_seconds(tmp_path):
    cfg = load_config(None, {})
    assert cfg.preemption.train_through_notice is True
    assert cfg.preemption.drain_lead_s == "auto" and cfg.preemption.fixed_drain_lead_s is None
    cfg = load_config(write(tmp_path, "preemption:\n  drain_lead_s: 20\n"), {})  # YAML reads a number
    assert cfg.preemption.fixed_drain_lead_s == 20.0
    cfg = load_config(None, {"TRAINGUARD_PREEMPTION_DRAIN_LEAD_S": "7.5"})
    assert cfg.preemption.fixed_drain_lead_s == 7.5


def test_env_types_and_unrelated_vars_ignored():
    env = {"TRAINGUARD_WORKERS_TEE": "false", "TRAINGUARD_WORKERS_ARGS": "--steps 50 --name 'a b'",
           "TRAINGUARD_RENDEZVOUS_IS_HOST": "true", "TRAINGUARD_PREEMPTION_SOURCES": "aws, signal",
           "TRAINGUARD_RT_CONTROL": "/x", "HOME": "/root"}
    cfg = load_config(None, env)
    assert cfg.workers.tee is False and cfg.workers.args == ["--steps", "50", "--name", "a b"]
    assert cfg.rendezvous.is_host is True and cfg.preemption.sources == ["aws", "signal"]
    # JSON works for every list and map
    cfg = load_config(None, {"TRAINGUARD_WORKERS_ARGS": '["--a,1", "x y"]', "TRAINGUARD_PREEMPTION_SOURCES": '["gcp"]',
                             "TRAINGUARD_WORKERS_ENV": '{"NCCL_DEBUG": "WARN", "N": 3}'})
    assert cfg.workers.args == ["--a,1", "x y"] and cfg.preemption.sources == ["gcp"]
    assert cfg.workers.env == {"NCCL_DEBUG": "WARN", "N": "3"}
    with pytest.raises(ConfigError, match="close the quote"):
        load_config(None, {"TRAINGUARD_WORKERS_ARGS": "--name 'unclosed"})


def test_rdzv_conf_and_standalone_flags():
    args = build_parser().parse_args(["run", "--rdzv-conf", "join_timeout=30,is_host=false", "--standalone", "x.py"])
    cfg = load_config(None, {}, overrides_from_args(args))
    assert cfg.rendezvous.join_timeout_s == 30.0 and cfg.rendezvous.min_nodes == cfg.rendezvous.max_nodes == 1
    with pytest.raises(ConfigError, match="unknown --rdzv-conf key"):
        overrides_from_args(build_parser().parse_args(["run", "--rdzv-conf", "bogus=1", "x.py"]))


def test_secrets_redacted_by_shape():
    so = {"key": "AKIA", "secret": "s3cr3t", "anything": "hidden1", "token": {"private_key": "pk"},
          "client_kwargs": {"endpoint_url": "http://x", "aws_secret_access_key": "zz", "region_name": "eu-1"}}
    env = {"TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": json.dumps(so),
           "TRAINGUARD_WORKERS_ENV": json.dumps({"WANDB_API_KEY": "w4ndb", "DB_PASSWD": "pw", "MY_VAR": "mine",
                                                 "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "CUDA_TOKEN": "cud4t0k"}),
           "TRAINGUARD_WORKERS_ARGS": "--api-key abc123 --lr=3e-4 -v positional 200 --password 4711 --secret=1234 -1"}
    out = redacted(load_config(None, env))
    text = json.dumps(out)
    for secret in ("AKIA", "s3cr3t", "hidden1", "pk", "zz", "w4ndb", "pw", "mine", "cud4t0k", "abc123", "positional", "4711", "1234"):
        assert secret not in text, secret
    assert out["checkpoint"]["storage_options"]["client_kwargs"] == {"endpoint_url": "http://x", "aws_secret_access_key": "***",
                                                                    "region_name": "eu-1"}
    assert out["checkpoint"]["storage_options"]["token"] == "***"
    assert out["workers"]["env"]["NCCL_DEBUG"] == "WARN" and out["workers"]["env"]["OMP_NUM_THREADS"] == "4"
    # plain numbers are shown (issue 43: `200` was `***`), unless they follow a secret-named flag
    assert out["workers"]["args"] == ["--api-key", "***", "--lr=3e-4", "-v", "***", "200", "--password", "***",
                                      "--secret=***", "-1"]
    # numbers are not secrets, whatever their name: aws_token_ttl_s stays readable
    assert out["preemption"]["aws_token_ttl_s"] == 21600
    assert redacted(load_config(None, {"TRAINGUARD_PREEMPTION_AZURE_VM_NAME": "vm-1"}))["preemption"]["azure_vm_name"] == "vm-1"


def test_config_keys_snapshot():
    """Renaming or removing a key is a deliberate change: update the snapshot and the README."""
    keys = {k: env_var_for(k) for k in all_keys()}
    if os.environ.get("TG_UPDATE_SNAPSHOTS") == "1":
        os.makedirs(os.path.dirname(SNAPSHOT), exist_ok=True)
        with open(SNAPSHOT, "w") as fh:
            json.dump(keys, fh, indent=1, sort_keys=True)
    with open(SNAPSHOT) as fh:
        assert keys == json.load(fh)


@pytest.mark.parametrize(("protocol", "backend", "max_nodes", "want"), [
    ("auto", "c10d", 1, "dynamic"),
    ("auto", "c10d", 32, "dynamic"),      # up to 32 nodes: torch's handler
    ("auto", "c10d", 33, "keyed"),        # above: O(N) bytes per change
    ("auto", "etcd", 1024, "keyed"),
    ("auto", "etcd-v2", 1024, "dynamic"),  # keyed runs on c10d and etcd only
    ("auto", "static", 64, "dynamic"),
    ("dynamic", "c10d", 1024, "dynamic"),  # an explicit choice stands
    ("keyed", "c10d", 2, "keyed"),
])
def test_resolve_protocol(protocol, backend, max_nodes, want):
    from trainguard.agent.config import resolve_protocol

    assert resolve_protocol(protocol, backend, max_nodes) == want


def test_auto_is_the_default_and_resolves_by_max_nodes():
    from trainguard.agent.config import RendezvousConfig

    assert RendezvousConfig().protocol == "auto" and RendezvousConfig().effective_protocol == "dynamic"
    assert RendezvousConfig(max_nodes=64).effective_protocol == "keyed"
    assert RendezvousConfig(backend="etcd-v2", endpoint="127.0.0.1:2379", max_nodes=64).effective_protocol == "dynamic"
    assert RendezvousConfig(protocol="dynamic", max_nodes=64).effective_protocol == "dynamic"
