"""The seams hold, proven by reading the source (STYLE §11): one adapter over torch elastic's
internals, one module for the worker environment contract, packages stacked in layers without a cycle
(``contract < checkpoint < strategies < runtime < agent``, metrics between the contract and the runtime),
no package reaching up into the agent."""

from __future__ import annotations

import ast
import os
import re

import pytest

from tests.harness import REPO

PACKAGES = ("contract", "agent", "runtime", "checkpoint", "strategies", "metrics")

# What each package may import of trainguard besides itself. The order is a line with one branch:
# contract < checkpoint < strategies < runtime < agent, and contract < metrics < runtime (metrics
# observe the path, never steer it, so nothing below the runtime reads them).
MAY_IMPORT = {
    "contract": set(),
    "checkpoint": {"contract"},
    "metrics": {"contract"},
    "strategies": {"contract", "checkpoint"},
    "runtime": {"contract", "checkpoint", "strategies", "metrics"},
    "agent": {"contract", "checkpoint", "strategies", "metrics", "runtime"},
}


def sources(*folders: str) -> dict[str, str]:
    out = {}
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    with open(path) as fh:
                        out[os.path.relpath(path, REPO)] = fh.read()
    return out


def imports(src: str) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import statement."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


# Private members of torch elastic objects trainguard relies on: only agent/elastic.py and its part
# agent/elastic_join.py (the rendezvous join) may touch them.
ELASTIC_ADAPTER = (os.path.join("agent", "elastic.py"), os.path.join("agent", "elastic_join.py"))
ELASTIC_PRIVATE = re.compile(r"\._(state_holder|op_executor|stop_heartbeats|start_heartbeats|remaining_restarts|pcontext|"
                             r"initialize_workers|restart_workers|stop_workers|monitor_workers|exit_barrier|"
                             r"worker_group|get_world|get_store|get_deadline|this_node|settings)\b")


def test_only_the_elastic_adapter_touches_torch_elastic_internals():
    offenders = []
    for path, src in sources(*PACKAGES).items():
        if path in ELASTIC_ADAPTER:
            continue
        for module, names in imports(src):
            private = [n for n in names if n.startswith("_")]
            if module.startswith("torch.distributed.elastic") and (private or any(p.startswith("_") for p in module.split("."))):
                offenders.append(f"{path}: from {module} import {private}")
        for m in ELASTIC_PRIVATE.finditer(src):
            offenders.append(f"{path}: {m.group(0)}")
    assert not offenders, "torch elastic internals outside agent/elastic.py and elastic_join.py:\n" + "\n".join(offenders)


def test_the_elastic_adapter_really_uses_them():
    src = sources("agent")
    assert "_RendezvousExitOp" in src[ELASTIC_ADAPTER[0]] and "._remaining_restarts" in src[ELASTIC_ADAPTER[0]]
    assert "_RendezvousJoinOp" in src[ELASTIC_ADAPTER[1]] and "._state_holder" in src[ELASTIC_ADAPTER[1]]  # not vacuous


def test_only_the_protocol_module_reads_or_writes_runtime_env_vars():
    offenders = [p for p, src in sources(*PACKAGES, "examples", "bench").items()
                 if "TRAINGUARD_RT_" in src and p != os.path.join("contract", "protocol", "env.py")]
    assert not offenders, offenders


AGENT_IMPORTS_ALLOWED = {
    # The control-plane bench drives the agents' own rendezvous path (issue 40) without their workers.
    # Its keyed runs count the keyed rendezvous's store requests (membership_kv, etcd_client, etcd_wire, the lease
    # stream's renewals, etcd_lease, the gRPC watches, etcd_watch, and the gRPC transactions, etcd_txn) on the wire,
    # and it measures the hang watch's store load (hang, hangwatch).
    os.path.join("bench", "control_plane.py"): {"trainguard.agent.config", "trainguard.agent.elastic",
                                                "trainguard.agent.etcd_rendezvous",
                                                "trainguard.agent.rendezvous", "trainguard.agent.keyed_stores",
                                                "trainguard.agent.membership_kv", "trainguard.agent.etcd_client",
                                                "trainguard.agent.etcd_wire", "trainguard.agent.etcd_lease",
                                                "trainguard.agent.etcd_watch", "trainguard.agent.etcd_txn",
                                                "trainguard.agent.hang", "trainguard.agent.hangwatch"},
    # The etcd watch bench (issue 40) times the gateway's watch against the gRPC one.
    os.path.join("bench", "etcd_watch.py"): {"trainguard.agent.etcd_watch", "trainguard.agent.etcd_client",
                                             "trainguard.agent.etcd_wire"},
    # The spot-trace simulation sizes the drain lead by the agents' own rule (auto_drain_lead).
    os.path.join("bench", "spot_trace.py"): {"trainguard.agent.lead"},
}


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "agent"] + ["examples", "bench"])
def test_no_package_imports_the_agent(package):
    offenders = [f"{path}: {module}" for path, src in sources(package).items()
                 for module, _ in imports(src) if (module == "trainguard.agent" or module.startswith("trainguard.agent."))
                 and module not in AGENT_IMPORTS_ALLOWED.get(path, set())]
    assert not offenders, offenders


def layering_violations(srcs: dict[str, str]) -> list[str]:
    """``path: module`` for every import (lazy and ``TYPE_CHECKING`` ones too) of a trainguard package
    that :data:`MAY_IMPORT` does not allow the importing package."""
    out = []
    for path, src in srcs.items():
        package = path.split(os.sep)[0]
        for module, _ in imports(src):
            parts = module.split(".")
            if parts[0] != "trainguard" or len(parts) < 2 or parts[1] == package:
                continue
            if parts[1] not in MAY_IMPORT[package]:
                out.append(f"{path}: {module}")
    return out


def test_packages_import_only_the_layers_below():
    offenders = layering_violations(sources(*MAY_IMPORT))
    assert not offenders, "imports against the layering (tests/test_layering.py MAY_IMPORT):\n" + "\n".join(offenders)


@pytest.mark.parametrize(("path", "line"), [
    (os.path.join("checkpoint", "manager.py"), "from trainguard.runtime.protocol import CheckpointTier"),
    (os.path.join("checkpoint", "manifest.py"), "import trainguard.strategies.base"),
    (os.path.join("contract", "protocol", "values.py"), "from trainguard.checkpoint.errors import CheckpointError"),
    (os.path.join("strategies", "fsdp.py"), "def f():\n    from trainguard.runtime import Runtime"),
    (os.path.join("metrics", "worker.py"), "from trainguard.checkpoint.state import TrainerState"),
    (os.path.join("runtime", "link.py"), "from trainguard.agent.control import ControlServer"),
])
def test_a_planted_back_import_is_caught(path, line):
    srcs = sources(*MAY_IMPORT)
    assert path in srcs  # the plant lands in a real module
    srcs[path] += "\n" + line + "\n"
    assert layering_violations(srcs) == [f"{path}: {imports(line)[0][0]}"]


def test_forward_imports_are_allowed():
    srcs = {os.path.join("agent", "x.py"): "from trainguard.runtime.runtime import Runtime",
            os.path.join("runtime", "x.py"): "from trainguard.metrics import WorkerMetrics",
            os.path.join("strategies", "x.py"): "from trainguard.checkpoint.state import ModelOptimizerState",
            os.path.join("checkpoint", "x.py"): "from trainguard.contract.log import get_logger"}
    assert layering_violations(srcs) == []


def module_graph(srcs: dict[str, str], package: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}``, lazy imports included, ``TYPE_CHECKING``
    ones left out (they never run)."""
    graph: dict[str, set[str]] = {}
    for path, src in srcs.items():
        tree = ast.parse(src)
        typing_only = {id(m) for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
                       for m in ast.walk(n)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            parts = node.module.split(".")
            if parts[:2] == ["trainguard", package]:
                deps |= {parts[2]} if len(parts) > 2 else {a.name for a in node.names}
        name = os.path.splitext(os.path.basename(path))[0]
        graph[name] = deps - {name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or ``[]``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            if found := visit(nxt, path + [node]):
                return found
        done.add(node)
        return []

    return next((c for m in sorted(graph) if (c := visit(m, []))), [])


def test_the_checkpoint_modules_import_each_other_without_a_cycle():
    """The checkpoint package's parts (the memory tier and its slots, skeleton, replicas, parity, lending
    and resharding; the durable manager, its save half, retention and the nearest-tier restore) form a
    graph without a cycle at run time, so each part can be read and tested from the ones below it."""
    srcs = sources("checkpoint")
    graph = module_graph(srcs, "checkpoint")
    assert {"memory", "slots", "skeleton", "nearest", "durablesave", "manager"} <= set(graph)
    assert not import_cycle(graph), import_cycle(graph)
    planted = dict(srcs)  # the check is not vacuous: a part importing the tier back closes a cycle
    planted[os.path.join("checkpoint", "skeleton.py")] += "\nfrom trainguard.checkpoint.memory import MemoryTier\n"
    assert {"memory", "skeleton"} <= set(import_cycle(module_graph(planted, "checkpoint")))


def test_the_contract_is_a_torch_free_leaf():
    for path, src in sources("contract").items():
        mods = [m for m, _ in imports(src)]
        # Only itself (the parts of the protocol package import each other), nothing else of trainguard.
        assert not [m for m in mods if m.startswith("trainguard") and not m.startswith("trainguard.contract.")], path
        assert not [m for m in mods if m.split(".")[0] in ("torch", "numpy", "fsspec", "prometheus_client")], path


def test_torch_is_a_tested_range_and_the_install_scripts_pin_the_cpu_wheel():
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert "2.13.0" in torch.specifier and "2.6.0" in torch.specifier  # a GPU user's build in range is kept
    assert "2.14.0" not in torch.specifier and "2.5.1" not in torch.specifier
    for script in (".ci/test", "examples/demo.sh"):
        with open(os.path.join(REPO, script)) as fh:
            assert "torch==2.13.0" in fh.read(), script
