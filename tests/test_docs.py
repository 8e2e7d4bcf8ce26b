"""The docs match the code:

* every log ``event`` the docs name — in an event table (first column ``event``, second ``fields``)
  or in prose (``logs `x```, ``(log event `x`)``, ``(`x`)`` next to "logs") — is emitted by a log
  call in the code, and every field an event table lists is passed by one of that event's calls;
* every ``docs/...``/``systemd/...`` path that a message in the code cites exists;
* ``docs/configuration.md`` lists every config key as the code declares it;
* the README's worker-API snippet runs as written (under ``trainguard run --standalone``) and ends
  with a ``final`` checkpoint, as its comment says;
* ``docs/install.md`` states the torch range the package declares and installs trainguard only from a
  checkout or a wheel (it is on no package index), and no page tells users to ``pip install
  trainguard`` from an index;
* the worker-log layout the docs give is the one the agent makes (``agent.log_dir`` under ``trainguard
  run`` and ``trainguard agent``, torch's ``<job_id>_<random>/attempt_<n>/<rank>`` below it), and no page
  or example suggests the deprecated ``etcd-v2`` as the alternative to c10d.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.harness import REPO

CODE_DIRS = ("contract", "agent", "runtime", "checkpoint", "metrics", "strategies", "examples")
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md")]


def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for d in CODE_DIRS:
        for path in glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as fh:
                out.append((path, ast.parse(fh.read(), path)))
    return out


def _dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def code_events() -> dict[str, set[str]]:
    """``{event: fields}`` from every structlog call, start-up warning and JSON ``print`` in the code.

    ``**expr`` arguments are resolved where the code makes it possible: a dict literal assigned to
    the same expression (``self._world = {...}``), or a method of that name returning a dict literal
    (``notice.log_fields()``). ``state_change`` also gets the keywords of ``StateMachine.to`` calls.
    """
    trees = _sources()
    assigned: dict[str, set[str]] = {}
    returned: dict[str, set[str]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for t in node.targets:
                    assigned.setdefault(ast.unparse(t), set()).update(_dict_keys(node.value))
            if isinstance(node, ast.FunctionDef):
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and isinstance(r.value, ast.Dict):
                        returned.setdefault(node.name, set()).update(_dict_keys(r.value))
    events: dict[str, set[str]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            first = node.args[0] if node.args else None
            if name in LOG_METHODS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                fields = events.setdefault(first.value, set())
                for kw in node.keywords:
                    if kw.arg is not None:
                        fields.add(kw.arg)
                    elif isinstance(kw.value, ast.Call) and isinstance(kw.value.func, ast.Attribute):
                        fields |= returned.get(kw.value.func.attr, set())
                    else:
                        fields |= assigned.get(ast.unparse(kw.value), set())
            elif name == "StartWarning" and isinstance(first, ast.Constant):
                events.setdefault(first.value, set()).update(_dict_keys(node.args[1]) if len(node.args) > 1 else set())
            elif name == "to" and isinstance(f, ast.Attribute) and "sm" in ast.unparse(f.value):
                events.setdefault("state_change", set()).update(kw.arg for kw in node.keywords if kw.arg)
            elif name == "dumps" and isinstance(first, ast.Dict):
                keys = _dict_keys(first)
                for k, v in zip(first.keys, first.values):
                    if isinstance(k, ast.Constant) and k.value == "event" and isinstance(v, ast.Constant):
                        events.setdefault(v.value, set()).update(keys - {"event"})
    # The state machine's own line: state_change carries old/new/after_s besides the details.
    return events


_CELL_TOKEN = re.compile(r"`([a-z][a-z0-9_]*)`")
_PROSE = [re.compile(p) for p in (r"logs `([a-z][a-z0-9_]+)`", r"log event `([a-z][a-z0-9_]+)`",
                                  r"logged `([a-z][a-z0-9_]+)`", r"`([a-z][a-z0-9_]+)` event\b")]


def doc_events() -> dict[tuple[str, str], set[str]]:
    """``{(doc, event): fields}`` for every event the docs name."""
    out: dict[tuple[str, str], set[str]] = {}
    for path in DOCS:
        doc = os.path.relpath(path, REPO)
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        in_table, has_fields = False, False
        for line in lines:
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            if cells and cells[0] == "`event`":
                in_table, has_fields = True, len(cells) > 1 and cells[1] == "fields"
                continue
            if in_table and cells:
                if set(cells[0]) <= set("-: "):
                    continue
                m = _CELL_TOKEN.fullmatch(cells[0])
                if m:
                    out.setdefault((doc, m.group(1)), set()).update(
                        _CELL_TOKEN.findall(cells[1]) if has_fields else [])
                continue
            in_table = False
            for rx in _PROSE:
                for ev in rx.findall(line):
                    out.setdefault((doc, ev), set())
    return out


def test_docs_name_real_events_and_fields():
    events = code_events()
    documented = doc_events()
    assert len(documented) >= 15, sorted(documented)  # the parser found the tables
    problems = []
    for (doc, ev), fields in sorted(documented.items()):
        if ev not in events:
            problems.append(f"{doc}: event `{ev}` is not logged anywhere in the code")
            continue
        known = events[ev] | ({"old", "new", "after_s"} if ev == "state_change" else set())
        missing = fields - known
        if missing:
            problems.append(f"{doc}: event `{ev}` has no field(s) {sorted(missing)} (the code logs {sorted(known)})")
    assert not problems, "\n".join(problems)


def test_the_parser_would_catch_a_wrong_event():
    """Guard against a vacuous pass: the issue's two mismatches are caught by the same functions."""
    events = code_events()
    assert "worker_exit" not in events
    assert not {"from", "to"} & events["state_change"]
    assert {"old", "new", "reason"} <= events["state_change"] | {"old", "new", "after_s"}


_CITED = re.compile(r"\b((?:docs|systemd|examples|metrics/(?:rules|dashboards))/[A-Za-z0-9_./-]+\.(?:md|service|example|yml|yaml|json|py|sh))")


def test_paths_cited_by_code_exist():
    cited: dict[str, set[str]] = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for p in _CITED.findall(node.value):
                    cited.setdefault(p, set()).add(os.path.relpath(path, REPO))
    assert "docs/configuration.md" in cited  # the unknown-key error cites it
    missing = {p: sorted(w) for p, w in cited.items() if not os.path.exists(os.path.join(REPO, p))}
    assert not missing, missing


def test_configuration_page_lists_every_key():
    from trainguard.agent.configdoc import BEGIN, END, reference
    from trainguard.agent.configload import all_keys

    with open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8") as fh:
        page = fh.read()
    block = BEGIN + page.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert block == reference(), "regenerate: python -m trainguard.agent.configdoc --write docs/configuration.md"
    for key in all_keys():
        assert f"| `{key}` |" in block


def readme_worker_api_snippet() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## The worker API", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


PRELUDE = textwrap.dedent("""\
    # Inputs the README's snippet takes as given; the snippet itself follows unchanged.
    import torch
    N, total_steps = 96, 6
    x, y = torch.randn(N, 8), torch.randn(N, 1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.mse_loss
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_worker_api_snippet_runs_as_written(tmp_path):
    snippet = readme_worker_api_snippet()
    assert "Runtime.from_env()" in snippet and "rt.finish()" in snippet
    script = tmp_path / "readme_snippet.py"
    script.write_text(PRELUDE + snippet)
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    r = subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "run", "--standalone", "--set", "metrics.port=0",
                        "--set", "preemption.sources=none", "--set", f"checkpoint.url={ckpt}", "--state-dir", str(tmp_path / "s"), "--set",
                        "checkpoint.interval_steps=4", "--set", "agent.log_format=json", str(script)],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=150)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = os.listdir(ckpt)
    steps = sorted(d for d in os.listdir(ckpt / run) if d.startswith("step-"))
    # periodic 4, final 6 (= total_steps); directories are named by step and epoch
    assert [d.split("-e")[0] for d in steps] == ["step-000000000004", "step-000000000006"], steps
    with open(ckpt / run / steps[-1] / "manifest.json") as fh:
        assert '"kind": "final"' in fh.read().replace('"kind":"final"', '"kind": "final"')


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts), encoding="utf-8") as fh:
        return fh.read()


def test_install_page_states_the_declared_torch_range_and_installs_from_a_checkout():
    import tomllib

    deps = tomllib.loads(_read("pyproject.toml"))["project"]["dependencies"]
    [torch_req] = [d for d in deps if re.match(r"torch\b", d)]
    install = _read("docs", "install.md")
    assert f"`{torch_req}`" in install, f"docs/install.md must state the declared range {torch_req}"
    assert not re.search(r"pins `torch==", install)
    bad = []
    for path in DOCS + [os.path.join(REPO, "systemd", "agent.yaml.example")]:
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            # a trainguard install from an index: `pip install trainguard`, `'trainguard[s3]'`, `trainguard==X`
            if re.search(r"pip install[^`\n]*?(?<![/.\w])'?trainguard(\[|==|\s|'|$)", line):
                bad.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert not bad, "trainguard is on no package index; install from the checkout or a wheel:\n" + "\n".join(bad)
    assert "pip wheel" in install and "source .venv/bin/activate" in _read("README.md")


def test_worker_log_layout_and_no_etcd_v2_advice():
    from trainguard.agent import cli, rundir
    from trainguard.agent.config import AgentConfig

    conf = _read("docs", "configuration.md")
    assert "`<agent.log_dir>/<job_id>/<job_id>_<random>/attempt_<n>/<rank>/`" in conf
    assert f"`{AgentConfig().log_dir}` for `trainguard agent`" in conf
    run_default = cli._user_defaults()["agent.log_dir"]
    assert run_default == os.path.join(rundir.private_base(), "logs")
    assert "`$TMPDIR/trainguard-<uid>/logs` for `trainguard run`" in conf
    sup = _read("agent", "supervisor.py")  # the agent hands torch <log_dir>/<job_id>; torch adds the rest
    assert "os.path.join(cfg.agent.log_dir, cfg.agent.job_id)" in sup and "DefaultLogsSpecs(log_dir=log_dir" in sup
    for rel in (("systemd", "agent.yaml.example"), ("docs", "operations.md")):
        text = _read(*rel)
        assert not re.search(r"(or|use) etcd-v2\b", text), f"{'/'.join(rel)} suggests the deprecated etcd-v2"
