"""Start-up checks of the agent (issue 43): a store it must reach (item 4) and a job id that finds no
checkpoint of its own beside other runs (item 2)."""

import pytest
import structlog


@pytest.mark.parametrize("backend, endpoint, is_host, reach", [
    ("c10d", "10.1.2.3:29400", None, ("10.1.2.3", 29400)),  # another machine: a client
    ("c10d", "127.0.0.1:29400", None, None),  # this machine: torch hosts the store
    ("c10d", "127.0.0.1:29400", False, ("127.0.0.1", 29400)),  # `trainguard store` on this machine
    ("c10d", "10.1.2.3:29400", True, None),
    ("etcd-v2", "10.1.2.3:2379", None, None),
])
def test_which_store_an_agent_waits_for(backend, endpoint, is_host, reach):
    """Item 4: the agent waits (with progress lines, bounded) only for a store it does not host."""
    from trainguard.agent.config import RendezvousConfig
    from trainguard.agent.rendezvous import store_to_reach

    cfg = RendezvousConfig(backend=backend, endpoint=endpoint, is_host=is_host, min_nodes=1, max_nodes=2)
    assert store_to_reach(cfg) == reach


def test_a_job_without_checkpoints_beside_other_runs_warns_loudly(tmp_path):
    """Item 2: `walk-job-l` (mistyped) next to `walk-job-1`, which has committed steps: one error line
    naming the other run, agent.job_id and the fix; none for the run itself or an empty URL."""
    import torch

    from trainguard.agent.configload import load_config
    from trainguard.agent.daemon import warn_foreign_runs
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    url = f"file://{tmp_path}/ck"

    def cfg(job):
        return load_config(None, {}, {"agent.job_id": job, "checkpoint.url": url, "workers.entrypoint": "t.py",
                                      "agent.state_dir": str(tmp_path / "s"), "agent.log_dir": str(tmp_path / "l")})

    with structlog.testing.capture_logs() as logs:
        assert warn_foreign_runs(cfg("walk-job-l")) == {}  # nothing under the URL yet
    with CheckpointManager(CheckpointConfig(url=url), "walk-job-1", rank=0, world_size=1) as mgr:
        mgr.save(266, {"w": torch.zeros(2)}, kind="final", block=True)
    with structlog.testing.capture_logs() as logs:
        assert warn_foreign_runs(cfg("walk-job-l")) == {"walk-job-1": 266}
        assert warn_foreign_runs(cfg("walk-job-1")) == {}  # its own checkpoint: silent
    [line] = [e for e in logs if e["event"] == "checkpoint_other_runs"]
    assert line["log_level"] == "error" and line["other_runs"] == {"walk-job-1": 266}
    assert "agent.job_id (TRAINGUARD_AGENT_JOB_ID" in line["fix"] and "step 0" in line["effect"]
