"""The test fault hooks fire where their spec says, once (the flag file records it), and nowhere else."""

import pytest

from trainguard.runtime.faults import FaultHooks


def test_no_spec_no_fault(tmp_path):
    hooks = FaultHooks("")
    hooks.fail_at("reform")
    assert hooks.snapshot_written() is None


def test_a_point_fails_once(tmp_path):
    flag = tmp_path / "flag"
    hooks = FaultHooks(f"reform:{flag}")
    hooks.fail_at("elsewhere")
    assert not flag.exists() and hooks.snapshot_written() is None
    with pytest.raises(RuntimeError, match="injected fault at reform"):
        hooks.fail_at("reform")
    assert "reform failed in pid" in flag.read_text()
    hooks.fail_at("reform")  # once per job: the flag file says it fired


def test_a_flag_file_made_first_holds_the_fault_back(tmp_path):
    flag = tmp_path / "flag"
    flag.write_text("")
    FaultHooks(f"reform:{flag}").fail_at("reform")
    hook = FaultHooks(f"snapshot_written:{flag}").snapshot_written()
    assert hook is not None
    hook(7)  # would SIGKILL this process without the flag file
