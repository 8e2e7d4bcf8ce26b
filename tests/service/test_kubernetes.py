"""docker/kubernetes/: the manifests validate against Kubernetes' OpenAPI schemas (``kubernetes-validate``),
agree with the agent's config, and the training pod's own command, run here with the environment Kubernetes
would give it, drains on ``preStop`` + the kubelet's SIGTERM and loses nothing (no cluster can run here)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import yaml

from tests.harness import (REPO, alive, free_port, json_events, memory_root, short_tmp,  # noqa: F401
                           wait_listening, wait_until)
from trainguard.agent.cli import build_parser
from trainguard.agent.configload import all_keys, load_config
from trainguard.contract.configbase import env_var_for

K8S = os.path.join(REPO, "docker", "kubernetes")
MANIFESTS = sorted(glob.glob(os.path.join(K8S, "*.yaml")))
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}
"""Custom resources: their schemas are not Kubernetes' own, so only their shape is checked here."""
VERSIONS = ("1.31.0", None)
"""The oldest version the manifests support (backoffLimitPerIndex, podFailurePolicy) and the newest shipped."""
POD = {"metadata.name": "trainguard-train-0-x7k2p", "status.podIP": "127.0.0.1", "spec.nodeName": "k8s-node-a"}
"""What the downward API would give the pod."""


def docs(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def find(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for d in docs(path):
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
    raise AssertionError(f"no {kind} {name} in {K8S}")


def test_there_are_manifests():
    kinds = {d["kind"] for p in MANIFESTS for d in docs(p)}
    assert {"Job", "Service", "Deployment", "NetworkPolicy", "Secret", "PodMonitor"} <= kinds, kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
@pytest.mark.parametrize("version", VERSIONS)
def test_manifest_validates_against_the_kubernetes_schema(path, version):
    import kubernetes_validate as kv

    version = version or kv.latest_version()
    for d in docs(path):
        if (d["apiVersion"], d["kind"]) in CRDS:
            continue
        kv.validate(d, version, strict=True)  # raises ValidationError naming the field


def test_validation_would_catch_a_wrong_field():
    import kubernetes_validate as kv

    job = find("Job", "trainguard-train")
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 110  # the real name ends in Seconds
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.latest_version(), strict=True)


def _pod_spec() -> dict[str, Any]:
    return find("Job", "trainguard-train")["spec"]["template"]["spec"]


def _container() -> dict[str, Any]:
    (c,) = _pod_spec()["containers"]
    return c


def pod_env() -> dict[str, str]:
    """The container's env as Kubernetes resolves it (downward API from :data:`POD`; optional Secrets absent)."""
    env = {}
    for e in _container()["env"]:
        env[e["name"]] = e["value"] if "value" in e else POD[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_the_pieces_agree():
    spec, c = _pod_spec(), _container()
    env = pod_env()
    known = {env_var_for(k) for k in all_keys()}
    assert set(env) - known == set(), "env vars that are no config keys"
    cfg = load_config(os.path.join(REPO, "docker", "agent.yaml"), env)  # the image's file + the pod's env
    grace = spec["terminationGracePeriodSeconds"]
    assert cfg.preemption.signal_deadline_s < grace  # the drain's deadline falls inside the pod's grace
    assert cfg.rendezvous.is_host is False and cfg.agent.node_name == POD["metadata.name"]
    assert cfg.checkpoint.memory_failure_domain == POD["spec.nodeName"]
    store = find("Deployment", "trainguard-store")["spec"]["template"]["spec"]["containers"][0]
    port = store["args"][store["args"].index("--port") + 1]
    assert cfg.rendezvous.endpoint == f"{find('Service', 'trainguard-store')['metadata']['name']}:{port}"
    prestop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "trainguard"
    args = build_parser().parse_args(prestop[1:])
    assert args.command == "drain" and args.deadline == cfg.preemption.signal_deadline_s
    metrics = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    ann = find("Job", "trainguard-train")["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == metrics == cfg.metrics.port and cfg.metrics.bind_address == "0.0.0.0"
    pm = find("PodMonitor", "trainguard-train")["spec"]
    labels = find("Job", "trainguard-train")["spec"]["template"]["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= labels.items() and pm["podMetricsEndpoints"][0]["port"] == "metrics"
    shm = {v["name"]: v for v in spec["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"] and cfg.checkpoint.memory_dir == "/dev/shm"
    svc = find("Service", "trainguard-train")
    assert svc["spec"]["clusterIP"] == "None" and spec["subdomain"] == svc["metadata"]["name"]
    # A pod whose agent drained or stopped with its work committed is no failure of the Job (exit codes).
    from trainguard.agent.exitcodes import ExitCode

    rules = find("Job", "trainguard-train")["spec"]["podFailurePolicy"]["rules"]
    ignored = {v for r in rules if r["action"] == "Ignore" and "onExitCodes" in r for v in r["onExitCodes"]["values"]}
    assert ignored == {ExitCode.DRAINED, ExitCode.STOPPED}


def _local(argv: list[str]) -> list[str]:
    """The container's argv on this machine: the image's entrypoint and config file mapped to the checkout."""
    argv = [a if a != "/etc/trainguard/agent.yaml" else os.path.join(REPO, "docker", "agent.yaml") for a in argv]
    return [sys.executable, "-m", "trainguard.agent.cli", *(argv[1:] if argv[0] == "trainguard" else argv)]


def _events(path: str, name: str) -> list[dict[str, Any]]:
    with open(path, errors="replace") as fh:
        return json_events(fh.read().splitlines(), name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pod_command_drains_on_prestop_and_sigterm_and_resumes(short_tmp):  # noqa: F811
    """The pod's args, env, preStop and grace from train-job.yaml; what differs here is overridden and named:
    loopback store on a free port (the Deployment's command), local checkpoint and state folders, one pod of
    one CPU worker, no cloud metadata, a smaller model step so the test is quick."""
    tmp = short_tmp
    store_args = find("Deployment", "trainguard-store")["spec"]["template"]["spec"]["containers"][0]["args"]
    port = free_port()
    store_argv = _local(["trainguard", *store_args])
    store_argv[store_argv.index("--port") + 1] = str(port)
    store_argv[store_argv.index("--host") + 1] = "127.0.0.1"  # tests talk to loopback only
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    store = subprocess.Popen(store_argv, env=clean, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    grace = _pod_spec()["terminationGracePeriodSeconds"]
    local = {"TRAINGUARD_RENDEZVOUS_ENDPOINT": f"127.0.0.1:{port}", "TRAINGUARD_CHECKPOINT_URL": f"{tmp}/ckpt",
             "TRAINGUARD_CHECKPOINT_MEMORY_DIR": memory_root(tmp), "TRAINGUARD_AGENT_STATE_DIR": f"{tmp}/state",
             "TRAINGUARD_AGENT_LOG_DIR": f"{tmp}/logs", "TRAINGUARD_WORKERS_NPROC_PER_NODE": "1",
             "TRAINGUARD_RENDEZVOUS_MIN_NODES": "1", "TRAINGUARD_PREEMPTION_SOURCES": "signal",
             "TRAINGUARD_METRICS_BIND_ADDRESS": "127.0.0.1", "TRAINGUARD_METRICS_PORT": "0",
             "TRAINGUARD_WORKERS_ARGS": pod_env()["TRAINGUARD_WORKERS_ARGS"] + " --step-sleep 0.05 --log-every 5",
             "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {**clean, **pod_env(), **local}
    procs: list[subprocess.Popen[bytes]] = []
    log = os.path.join(tmp, "pod.log")

    def start_pod() -> subprocess.Popen[bytes]:
        with open(log, "ab") as fh:
            p = subprocess.Popen(_local(_container()["args"]), env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=tmp)
        procs.append(p)
        return p

    try:
        wait_listening(f"127.0.0.1:{port}")
        pod = start_pod()
        wait_until(lambda: any(e["step"] >= 20 for e in _events(log, "train_step")), 180, "20 steps")
        prestop = subprocess.run(_local(_container()["lifecycle"]["preStop"]["exec"]["command"]), env=env,
                                 capture_output=True, text=True, timeout=60, cwd=tmp)
        assert prestop.returncode == 0, prestop.stderr
        t_term = time.time()
        pod.send_signal(signal.SIGTERM)  # the kubelet, once preStop returned
        assert pod.wait(grace) == 3  # drained, work committed: the Job's podFailurePolicy ignores it (below)
        took = time.time() - t_term
        committed = [e for e in _events(log, "checkpoint_committed") if e.get("kind") == "emergency"
                     and e.get("component") == "trainguard.worker"]
        assert len(committed) == 1 and committed[0]["before_deadline"], committed
        s = committed[0]["step"]
        assert max(e["step"] for e in _events(log, "train_step")) <= s  # nothing trained after it was saved
        notices = _events(log, "preemption_notice")
        assert notices and notices[0]["source"] == "manual" and notices[0]["detail"]["reason"] == "pod preStop", notices

        # The Job recreates the index's pod (a new pod name): it resumes at the emergency step.
        env["TRAINGUARD_AGENT_NODE_NAME"] = "trainguard-train-0-q9w3z"
        pod = start_pod()
        resumed = wait_until(lambda: _events(log, "resumed"), 180, "the new pod resumes")
        assert resumed[0]["step"] == s, (resumed, s)
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(grace) == 4  # stopped (SIGTERM alone), work committed: ignored by the policy too
        print(f"preStop + SIGTERM: drained in {took:.1f} s (grace {grace} s) at step {s}; the new pod resumed at {s}")
    except AssertionError:
        with open(log, errors="replace") as fh:
            print("\n".join(fh.read().splitlines()[-60:]))
        raise
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        wait_until(lambda: not any(alive(p.pid) for p in procs), 10, "the pods' processes gone")
        shutil.rmtree(memory_root(tmp), ignore_errors=True)  # the pod's tier-0 folder (empty once drained)
