"""Start-up checks of the agent (issue 43): a store it must reach (item 4) and a job id that finds no
checkpoint of its own beside other runs (item 2)."""

import pytest
import structlog

from trainguard.agent.daemon import warn_foreign_runs  # imports the supervisor (its env var) at collection


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


def test_a_restarted_agent_exports_the_stores_last_commit_from_the_first_scrape(tmp_path):
    """Item 8: after an agent restart the last-commit series come from the job's newest committed step
    in the store (not absent until the next commit), labelled with the job id; another job's steps are
    not this job's."""
    import time

    import torch

    from trainguard.agent.configload import load_config
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.metrics.agent import AgentMetrics
    from trainguard.metrics.config import CostConfig, MetricsConfig

    url = f"file://{tmp_path}/ck"
    t0 = time.time()
    with CheckpointManager(CheckpointConfig(url=url), "walk-job-1", rank=0, world_size=1) as mgr:
        mgr.save(266, {"w": torch.zeros(2)}, block=True)
    with CheckpointManager(CheckpointConfig(url=url), "other-job", rank=0, world_size=1) as mgr:
        mgr.save(900, {"w": torch.zeros(2)}, block=True)

    def scrape(job):
        cfg = load_config(None, {}, {"agent.job_id": job, "checkpoint.url": url, "workers.entrypoint": "t.py",
                                     "agent.state_dir": str(tmp_path / "s"), "agent.log_dir": str(tmp_path / "l")})
        m = AgentMetrics(MetricsConfig(port=0), CostConfig(), "node-a", job_id=job, start_sampler=False)
        try:
            warn_foreign_runs(cfg, m)
            return {s.name: (s.value, s.labels) for fam in m.registry.collect() for s in fam.samples
                    if s.name.startswith("trainguard_checkpoint_last_commit")}
        finally:
            m.close()

    got = scrape("walk-job-1")
    step, labels = got["trainguard_checkpoint_last_committed_step"]
    ts, _ = got["trainguard_checkpoint_last_commit_timestamp_seconds"]
    assert step == 266 and labels == {"node": "node-a", "job_id": "walk-job-1"}
    assert t0 - 1 <= ts <= time.time()
    assert scrape("new-job") == {}  # nothing committed for it: absent, as before
