"""``trainguard checkpoints verify URL [STEP]`` (issue 43, item 3): an offline CRC check in a real
process, with an exit status a script can act on, and nothing in storage changed by it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import step_dir

pytestmark = pytest.mark.timeout(120)


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "checkpoints", "verify", *args],
                          capture_output=True, text=True, timeout=90)


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_verify_names_the_damaged_file_and_exits_non_zero(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    with CheckpointManager(CheckpointConfig(url=url, keep_last=5), "run-a", rank=0, world_size=1) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((256,), float(step))}, block=True)
    shard = Path(url, "run-a", step_dir(20, 1), "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = _tree(Path(url))

    r = _verify(url)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line.split()[2] for line in r.stdout.splitlines()
            if line[:1].isdigit() and len(line.split()) == 4}
    assert rows == {"10": "intact", "20": "CORRUPT", "30": "intact"}
    assert f"step 20@e1: {shard.as_posix()}" in r.stdout and "crc32 0x" in r.stdout and "!= 0x" in r.stdout
    assert "1 of 3 step(s) damaged" in r.stdout

    r = _verify(url, "30")
    assert r.returncode == 0 and "all 1 step(s) intact" in r.stdout, r.stdout + r.stderr
    r = _verify(f"{url}/run-a", "20", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["exit"] == 1
    assert [(s["step"], s["result"], s["files"]) for s in doc["steps"]] == [(20, "corrupt", 2)]
    r = _verify(url, "25")
    assert r.returncode == 2 and "no committed step 25" in r.stderr and "checkpoints ls --all" in r.stderr

    shard.unlink()  # a file missing from a listing that succeeded is damage too
    r = _verify(url, "20")
    assert r.returncode == 1 and "missing" in r.stdout, r.stdout
    assert _tree(Path(url)) == {k: v for k, v in before.items() if not k.endswith(f"{step_dir(20, 1)}/__0_0.distcp")}
