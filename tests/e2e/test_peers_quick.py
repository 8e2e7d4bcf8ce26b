"""``bench/peers.py`` in CI: the harness in a tiny configuration, with the two rows CI can run (plain
torchrun and trainguard; the other peers are an optional extra the test command does not install) and one
fault (a whole node SIGKILLed). Asserts the JSON's shape and that trainguard's job completed with every
step committed once and every sample used once. No timed assertion: the figures are the bench's to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO, bench_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CELL_KEYS = {"peer", "fault", "recovered", "completed", "last_step", "skipped", "repeated", "fault_at_step"}


def test_peers_quick(tmp_path) -> None:
    out = tmp_path / "peers.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers.py"), "--peers", "torchrun,trainguard",
                           "--faults", "kill_node", "--steps", "80", "--warm", "10", "--recover-wait", "150",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    report = json.loads(out.read_text())
    assert set(report["peers"]) == {"torchrun", "trainguard"}, report["peers"]
    assert report["faults"] == ["kill_node"]
    cells = {(c["peer"], c["fault"]): c for c in report["cells"]}
    assert set(cells) == {("torchrun", "kill_node"), ("trainguard", "kill_node")}
    for cell in cells.values():
        assert "error" not in cell, cell
        assert CELL_KEYS <= set(cell), cell
        assert cell["fault_at_step"] < 80, cell
    tg = cells[("trainguard", "kill_node")]
    assert tg["recovered"] and tg["world_after"] == 1, tg
    assert tg["completed"] and tg["last_step"] == 80, tg
    assert tg["every_step_once"], tg.get("every_step_once_error")
    assert tg["skipped"] == 0 and tg["repeated"] == 0, tg
    assert report["peers"]["trainguard"]["step_s"] is not None
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_table_reports_a_fault_never_recovered() -> None:
    with bench_module("peers.py") as peers:
        text = peers.table({"cells": [{"peer": "trainguard", "fault": "hang", "recovered": False,
                                       "note": "not recovered within 120 s"}],
                            "peers": {"trainguard": {"settings": "defaults", "step_s": 0.05},
                                      "dlrover": {"not_run": "not installed"}}})
    row = next(line for line in text.splitlines() if line.startswith("trainguard") and "hang" in line)
    assert "never" in row and "not recovered within 120 s" in row
    assert any(line.startswith("dlrover") and "not installed" in line for line in text.splitlines())


def test_summary_gives_medians_spread_and_the_worst_run() -> None:
    cells = [
        {"peer": "trainguard", "fault": "hang", "rep": 0, "recovered": True, "recover_s": 1.4, "lost_steps": 0,
         "skipped": 0, "repeated": 0, "world_after": 1, "completed": True},
        {"peer": "trainguard", "fault": "hang", "rep": 1, "recovered": True, "recover_s": 0.9, "lost_steps": 1,
         "skipped": 0, "repeated": 24, "world_after": 1, "completed": True},
        {"peer": "trainguard", "fault": "hang", "rep": 2, "recovered": False, "note": "not recovered within 120 s",
         "skipped": 0, "repeated": 0, "completed": False},
        {"peer": "torchft", "fault": "hang", "rep": 0, "recovered": False, "error": "BenchError: no start"},
        {"peer": "torchft", "fault": "hang", "rep": 1, "recovered": False, "error": "BenchError: no start"},
    ]
    with bench_module("peers.py") as peers:
        tg, ft = peers.summarize(cells)
        text = peers.table({"cells": cells, "peers": {"trainguard": {"settings": "defaults"}}})
    assert (tg["peer"], tg["runs"], tg["recovered"]) == ("trainguard", 3, 2)
    assert tg["recover_s"] == 1.15 and (tg["recover_min_s"], tg["recover_max_s"]) == (0.9, 1.4)
    assert (tg["lost_steps"], tg["repeated"], tg["world_after"], tg["completed"]) == (1, 24, [1], 2)
    assert tg["notes"] == ["not recovered within 120 s"]
    assert (ft["recovered"], ft["recover_s"], ft["notes"]) == (0, None, ["BenchError: no start"])
    row = next(line for line in text.splitlines() if line.startswith("trainguard"))
    assert "1.15" in row and "0.90-1.40" in row and "2/3" in row
    row = next(line for line in text.splitlines() if line.startswith("torchft"))
    assert "never" in row and "0/2" in row and "no start" in row
    assert "join" not in text  # no join cell, no pause line


def test_a_join_row_reports_the_worlds_pause() -> None:
    cells = [{"peer": "trainguard", "fault": "join", "rep": r, "recovered": True, "recover_s": rec, "join_pause_s": pause,
              "world_after": 3, "completed": True} for r, (rec, pause) in enumerate([(4.0, 0.5), (5.0, 0.7), (4.5, 0.6)])]
    with bench_module("peers.py") as peers:
        (row,) = peers.summarize(cells)
        text = peers.table({"cells": cells, "peers": {}})
    assert row["join_pause_s"] == 0.6 and row["recover_s"] == 4.5
    assert "trainguard join: the world paused 0.60 s" in text and "of 4.50 s" in text


def test_ray_run_processes_are_found_by_their_environment(tmp_path) -> None:
    """Ray renames its processes and some outlive their raylet's tree: the Ray rows sweep what carries the
    run's marker in its environment, and only that."""
    mark = str(tmp_path / "tgray-x")
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "TG_BENCH_RAY": mark})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "TG_BENCH_RAY": mark + "-other"})
    try:
        with bench_module("peers.py") as peers:
            found = peers.RayPeer.marked(mark)
        assert mine.pid in found and other.pid not in found, found
    finally:
        for p in (mine, other):
            p.kill()
            p.wait(10)


def test_the_training_process_is_found_behind_the_prestarted_interpreter() -> None:
    """kill_worker and hang aim at the process that runs the job script, whether python runs it directly or
    trainguard's prestarted interpreter does (``-m trainguard.runtime.warm FD -- SCRIPT``)."""
    with bench_module("peers.py") as peers:
        assert peers.program_of(["-u", "/j/job.py", "--steps", "5"]) == "/j/job.py"
        assert peers.program_of(["-u", "-m", "trainguard.runtime.warm", "7", "--", "/j/job.py", "--steps"]) == "/j/job.py"
        assert peers.program_of(["-m", "trainguard.runtime.shim", "--", "-u", "/j/job.py"]) == "trainguard.runtime.shim"
        assert peers.program_of(["/usr/bin/ft_monitor", "/j/job.py"]) == "/usr/bin/ft_monitor"  # a helper naming it
