"""The seams hold, proven by reading the source (STYLE §11): one adapter over torch elastic's
internals, one module for the worker environment contract, no package reaching up into the agent."""

from __future__ import annotations

import ast
import os
import re

import pytest

from tests.harness import REPO

PACKAGES = ("agent", "runtime", "checkpoint", "strategies", "metrics")


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


# Private members of torch elastic objects trainguard relies on: only agent/elastic.py may touch them.
ELASTIC_PRIVATE = re.compile(r"\._(state_holder|op_executor|stop_heartbeats|start_heartbeats|remaining_restarts|pcontext|"
                             r"initialize_workers|restart_workers|stop_workers|monitor_workers|exit_barrier|"
                             r"worker_group|get_world|get_store|get_deadline|this_node|settings)\b")


def test_only_the_elastic_adapter_touches_torch_elastic_internals():
    offenders = []
    for path, src in sources(*PACKAGES).items():
        if path == os.path.join("agent", "elastic.py"):
            continue
        for module, names in imports(src):
            private = [n for n in names if n.startswith("_")]
            if module.startswith("torch.distributed.elastic") and (private or any(p.startswith("_") for p in module.split("."))):
                offenders.append(f"{path}: from {module} import {private}")
        for m in ELASTIC_PRIVATE.finditer(src):
            offenders.append(f"{path}: {m.group(0)}")
    assert not offenders, "torch elastic internals outside agent/elastic.py:\n" + "\n".join(offenders)


def test_the_elastic_adapter_really_uses_them():
    src = sources("agent")[os.path.join("agent", "elastic.py")]
    assert "_RendezvousExitOp" in src and "._remaining_restarts" in src  # the test above is not vacuous


def test_only_the_protocol_module_reads_or_writes_runtime_env_vars():
    offenders = [p for p, src in sources(*PACKAGES, "examples", "bench").items()
                 if "TRAINGUARD_RT_" in src and p != os.path.join("runtime", "protocol.py")]
    assert not offenders, offenders


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "agent"] + ["examples", "bench"])
def test_no_package_imports_the_agent(package):
    offenders = [f"{path}: {module}" for path, src in sources(package).items()
                 for module, _ in imports(src) if module == "trainguard.agent" or module.startswith("trainguard.agent.")]
    assert not offenders, offenders


@pytest.mark.parametrize("leaf", ["protocol", "log", "configbase"])
def test_leaf_modules_import_nothing_of_trainguard(leaf):
    src = sources("runtime")[os.path.join("runtime", f"{leaf}.py")]
    assert not [m for m, _ in imports(src) if m.startswith("trainguard")]


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
