"""The worker's process groups: the first world from the torchelastic env (:func:`first_world`), the gloo
side groups (step agreement, checkpoints) and the record of a strategy's own groups. A part of
:class:`~trainguard.runtime.runtime.Runtime`."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.contract import protocol as proto
from trainguard.runtime import device as dev
from trainguard.runtime import reform as rf


def first_world(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Initialise the process group from the torchelastic env (see :meth:`Runtime.from_env
    <trainguard.runtime.runtime.Runtime.from_env>`) and return the runtime's constructor arguments."""
    rtenv = proto.RuntimeEnv.from_env(env)
    from trainguard.contract import log as tglog

    tglog.configure(rtenv.log_format or "auto")  # the agent's format (its output tees ours), else by stderr
    reform = rtenv.reform and rtenv.under_agent
    device = dev.select_device(rtenv.local_rank)
    dev.bind(device)  # before init_process_group, and before the script builds anything on the GPU
    if not rtenv.standby and (rtenv.world_size > 1 or reform) and not dist.is_initialized():
        if rtenv.under_agent and rtenv.master_addr:
            # Every worker a trainguard agent starts joins through the arrival count that a re-formed
            # worker's join waits on (reform.arrive): fresh and re-formed workers can share a world.
            rf.init_world(rank=rtenv.rank, world_size=rtenv.world_size, local_rank=rtenv.local_rank,
                          local_world_size=rtenv.local_world_size, master_addr=rtenv.master_addr,
                          master_port=rtenv.master_port, device=device, timeout_s=rtenv.pg_timeout_s)
        else:
            dist.init_process_group(dev.backend_for(device), **dev.init_kwargs(device, rtenv.pg_timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else (-1 if rtenv.standby else 0)
    return dict(rank=rank, world_size=rtenv.world_size, local_rank=rtenv.local_rank,
                job_id=rtenv.job_id or rtenv.run_id or "trainguard", rdzv_id=rtenv.run_id,
                rdzv_round=rtenv.round, checkpoint=CheckpointConfig(**rtenv.checkpoint),
                control_path=rtenv.control_path, reform=reform, reform_timeout_s=rtenv.reform_timeout_s,
                pg_timeout_s=rtenv.pg_timeout_s, standby=rtenv.standby, local_world_size=rtenv.local_world_size,
                inject_fault=rtenv.inject_fault, device=device, memory_dir=rtenv.memory_dir,
                step_agreement=rtenv.step_agreement, step_agreement_period_s=rtenv.step_agreement_period_s,
                progress_interval_s=rtenv.progress_interval_s)


class Groups:
    """Mixin of :class:`~trainguard.runtime.runtime.Runtime` (its state and its other methods)."""

    def _group_connections(self) -> contextlib.AbstractContextManager[None]:
        """With a strategy that makes groups of its own (:attr:`Strategy.makes_groups`), record the gloo
        connections of the groups made inside (its device-mesh sub-groups), so
        that a rank that parks after a peer failure ends them too (:func:`rf.end_world_connections`): a
        survivor blocked in a collective of such a group with this rank (model_parallel's tensor-parallel
        all-reduce) fails it at once instead of waiting out the process-group timeout."""
        if self.strategy is None or not self.strategy.makes_groups or dev.backend_for(self.device) != "gloo":
            return contextlib.nullcontext()  # only a strategy's own groups: nothing else opened meanwhile is recorded
        return rf.world_connections()

    def _new_gloo_group(self) -> Any:
        """A gloo side group with ``workers.pg_timeout_s`` (torch's default when unset)."""
        kw: dict[str, Any] = {"timeout": timedelta(seconds=self.pg_timeout_s)} if self.pg_timeout_s > 0 else {}
        with rf.world_connections():
            return dist.new_group(backend="gloo", **kw)
