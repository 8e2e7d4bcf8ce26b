"""The trainguard worker API: a few lines in a training script buy emergency checkpoints, async
sharded checkpoints and exact data resumption at any world size.

::

    rt = Runtime.from_env()                                   # process group from the torchelastic env
    model, opt = rt.setup(model, opt, dataset_size=N, global_batch=24, micro_batch=4, seed=1,
                          strategy="fsdp", precision="bf16-mixed")   # or "ddp" (default), "32", ...
    rt.restore()                                              # latest committed checkpoint, resharded
    while rt.step < total_steps:
        micro = rt.next_batches()                             # this rank's sample ids, per micro-batch
        for i, ids in enumerate(micro):
            with rt.accumulating(last=i == len(micro) - 1):   # gradient sync only on the last one
                with rt.autocast():                           # the precision's forward context
                    loss = loss_fn(model(x[ids]), y[ids]) / len(micro)
                rt.backward(loss)                             # loss.backward(), scaled for 16-mixed
        rt.optimizer_step(opt); opt.zero_grad()               # opt.step() (+ scaler step/update)
        rt.end_step()                                         # checkpoints; may exit with code 75
    rt.finish()

**Strategy.** How model and optimizer are spread over the ranks (DDP, FSDP2, ...) is a
:class:`~trainguard.strategies.base.Strategy`, chosen by name or passed built. The runtime only uses
its interface: ``setup`` wraps, ``no_sync`` drives accumulation, ``state`` is the model/optimizer entry
of the checkpoint, ``data_parallel`` says which ranks share a part of the batch, ``plan`` splits the
global batch, and ``name`` goes into the manifest. With the
32-bit precision ``rt.autocast()``/``rt.backward()``/``rt.optimizer_step()`` are plain
``nullcontext``/``loss.backward()``/``opt.step()``, so scripts that call those directly keep working.

**Agreement at a step boundary.** ``end_step`` all-reduces (MAX) a 2-element flag over a side gloo
group: ``[stop, periodic_due]`` where ``stop`` is 2 for a drain and 1 for a resize request this rank's
agent pushed over the control socket (or SIGTERM under plain torchrun). Every rank therefore sees
the same flags after the same step: all of them save the same step ``s``, rank 0 commits it, and all
exit with :data:`~trainguard.runtime.protocol.EXIT_RESIZE`. The new world restores ``s`` and continues at
``s + 1``. Cost: one 8-byte all-reduce per step.

**Data.** A :class:`~trainguard.runtime.cursor.GlobalSampleCursor` (seeded permutation per epoch,
samples consumed) is part of the checkpoint; each global batch is split over the current
data-parallel ranks (all ranks, unless the strategy groups them: ``model_parallel``'s tensor-parallel
groups share one part) and the global batch stays constant by adapting gradient accumulation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import TrainerState
from trainguard.runtime import protocol as proto
from trainguard.runtime.cursor import GlobalSampleCursor
from trainguard.runtime.link import AgentLink
from trainguard.runtime.log import get_logger
from trainguard.strategies.base import Strategy, get_strategy
from trainguard.strategies.batch import split

log = get_logger("trainguard.worker")


class Runtime:
    """One worker's link to trainguard. Not thread-safe: the training loop owns it."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, job_id: str, fence: int,
                 checkpoint: CheckpointConfig, control_path: str = "", strategy: str | Strategy = "ddp") -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.job_id, self.fence = job_id, fence
        self._strategy_arg: str | Strategy = strategy
        self.strategy: Strategy | None = None
        self.checkpoint_config = checkpoint
        self.step = 0
        self.cursor: GlobalSampleCursor | None = None
        self.accum_steps = 1
        self.micro_batch = 1
        self.dp_rank, self.dp_size = rank, world_size
        """This rank's data-parallel share of each global batch and the number of shares (see
        :meth:`~trainguard.strategies.base.Strategy.data_parallel`; the rank and world without TP)."""
        self._counts_samples = True
        self._signal_request = proto.StopReason.NONE
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._trainer = TrainerState()
        self._manager: CheckpointManager | None = None
        self._last_periodic = time.monotonic()
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._link = (AgentLink(control_path, rank, local_rank, os.getpid())
                      if control_path and os.path.exists(control_path) else None)
        self._metrics: Any = None
        if threading.current_thread() is threading.main_thread():
            # Under plain torchrun (no agent link) a SIGTERM is the only notice a worker gets.
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._log = log.bind(rank=rank, world_size=world_size, fence=fence)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Runtime:
        """Initialise the process group from the torchelastic env (gloo on CPU, NCCL on GPU) and read
        the agent's :class:`~trainguard.runtime.protocol.RuntimeEnv`. Works under plain torchrun and alone too."""
        rtenv = proto.RuntimeEnv.from_env(env)
        from trainguard.runtime import log as tglog

        tglog.configure("auto")  # JSON lines when stderr is a log file, as the agent's
        if rtenv.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(rank=rank, world_size=rtenv.world_size, local_rank=rtenv.local_rank,
                   job_id=rtenv.job_id or rtenv.run_id or "trainguard", fence=max(rtenv.round, 0),
                   checkpoint=CheckpointConfig(**rtenv.checkpoint), control_path=rtenv.control_path)

    @property
    def strategy_name(self) -> str:
        """The strategy's registry name (recorded in checkpoint manifests)."""
        return self.strategy.name if self.strategy is not None else str(getattr(self._strategy_arg, "name", self._strategy_arg))

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, dataset_size: int,
              global_batch: int, micro_batch: int, seed: int = 0, tokens_per_sample: int = 0,
              strategy: str | Strategy | None = None, precision: str | int | None = None,
              strategy_options: dict[str, Any] | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` and ``optimizer`` with the strategy (``"ddp"`` by default, ``"fsdp"``, or a
        built :class:`~trainguard.strategies.base.Strategy`), set up the data cursor and the checkpoint
        manager; use the returned model and optimizer from then on (FSDP rebuilds the optimizer over its
        sharded parameters). ``precision`` (``32``, ``bf16-mixed``, ``16-mixed``) and
        ``strategy_options`` are passed to the strategy when it is given by name. ``global_batch``
        stays constant at every world size: ranks x accumulation steps x ``micro_batch``; raises
        ``ValueError`` when it cannot divide."""
        chosen = self._strategy_arg if strategy is None else strategy
        options = dict(strategy_options or {})
        if precision is not None:
            options["precision"] = precision
        self.strategy = get_strategy(chosen, **options)
        # The batch is split over data-parallel shares; ranks of one share (a TP group) get the same samples.
        self.dp_rank, self.dp_size = self.strategy.data_parallel(self.rank, self.world_size)
        self._counts_samples = self.rank == min(
            r for r in range(self.world_size) if self.strategy.data_parallel(r, self.world_size)[0] == self.dp_rank)
        self.accum_steps, _ = self.strategy.plan(global_batch, self.dp_size, micro_batch)
        self.micro_batch = micro_batch
        self.tokens_per_sample = tokens_per_sample
        self.cursor = GlobalSampleCursor(dataset_size, global_batch, seed)
        from trainguard.metrics import WorkerMetrics

        # A no-op (one warning) when the agent set up no metrics channel, e.g. under plain torchrun.
        self._metrics = WorkerMetrics(self.rank, self.local_rank)
        self._step_started = time.monotonic()
        self._model, self._optimizer = self.strategy.setup(model, optimizer)
        self._trainer = TrainerState(seed=seed,
                                     config_fingerprint=f"gb={global_batch},n={dataset_size},seed={seed}")
        if self.checkpoint_config.url:
            # The manager makes its own gloo group: its background persist thread runs collectives that
            # must never interleave with the step-flag all-reduce the training thread runs on ours.
            self._manager = CheckpointManager(self.checkpoint_config, self.job_id, rank=self.rank, world_size=self.world_size,
                                              fence=self.fence, strategy=self.strategy_name)
        self._log.info("worker_setup", accum_steps=self.accum_steps, micro_batch=micro_batch, global_batch=global_batch,
                       checkpoints=self._manager.url if self._manager else None, agent_link=self._link is not None,
                       resize_rule=self.strategy.resize_rule, **self.strategy.describe())
        return self._model, self._optimizer

    # ---- checkpoints ----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        assert self._model is not None and self.cursor is not None and self.strategy is not None, "setup() first"
        self._trainer.step = self.step
        self._trainer.cursor = self.cursor.state_dict()
        return {"app": self.strategy.state(self._model, self._optimizer), "trainer": self._trainer}

    def restore(self, step: int | None = None) -> int:
        """Load the newest committed checkpoint (or the committed ``step``), saved at any world size,
        and return the step to continue from."""
        if self._manager is None:
            return self.step
        state = self._state()
        step = self._manager.restore(state, step)
        if step is not None:
            self.step = self._trainer.step
            assert self.cursor is not None
            self.cursor.load_state_dict(self._trainer.cursor)
            self._log.info("worker_restored", step=step, saved_world_size=self._trainer.saved_world_size,
                           epoch=self.cursor.epoch, consumed=self.cursor.consumed)
        return self.step

    def _save(self, kind: str) -> float:
        assert self._manager is not None
        t0 = time.monotonic()
        self._manager.save(self.step, self._state(), kind=kind, block=kind != "periodic")
        seconds = time.monotonic() - t0
        blocked = self._manager.last_blocked_s
        in_flight = self._manager.pending if kind == "periodic" else None
        if in_flight is None:  # committed now
            self._metrics.observe_checkpoint(kind, blocked, seconds - blocked, blocked, 0, self.step, True)
        else:  # persisted and committed in the background: recorded when that finishes
            self._metrics.observe_checkpoint_async(in_flight, kind, blocked, blocked, self.step)
        return seconds

    # ---- the step -------------------------------------------------------------------------------
    def next_batches(self) -> list[list[int]]:
        """This rank's share of the next global batch, as ``accum_steps`` lists of sample ids."""
        assert self.cursor is not None, "setup() first"
        ids = self.cursor.next_global_batch()
        return split(ids, self.dp_rank, self.dp_size, self.micro_batch)

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """Skip the strategy's gradient synchronisation on all but the last micro-batch of a step."""
        assert self.strategy is not None and self._model is not None, "setup() first"
        with self.strategy.no_sync(self._model, last):
            yield

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The precision's context for forward + loss (a no-op at 32-bit)."""
        assert self.strategy is not None, "setup() first"
        return self.strategy.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when the precision uses a loss scaler (``16-mixed``)."""
        assert self.strategy is not None, "setup() first"
        self.strategy.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """``optimizer.step()`` (the one ``setup`` returned by default); with a loss scaler it unscales,
        skips the step on inf/nan gradients (on every rank alike) and updates the scale."""
        assert self.strategy is not None and self._optimizer is not None, "setup() first"
        self.strategy.optimizer_step(optimizer or self._optimizer)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._signal_request = proto.StopReason.DRAIN

    def _local_request(self) -> proto.StopReason:
        return max(self._signal_request, self._link.request if self._link else proto.StopReason.NONE)

    def end_step(self) -> None:
        """Call after ``optimizer.step()``: counts the step, agrees with every rank on drain/resize and
        periodic checkpoints, saves, and exits with code 75 after an emergency/resize checkpoint."""
        self.step += 1
        assert self.cursor is not None, "setup() first"
        now = time.monotonic()
        # One rank per data-parallel share counts its samples, so the job's sum is the global batch.
        per_rank = self.cursor.global_batch_size // self.dp_size if self._counts_samples else 0
        self._metrics.observe_step(self.step, per_rank, per_rank * self.tokens_per_sample, now - self._step_started)
        self._metrics.sample_gpu_peak(now)
        self._step_started = now
        cfg = self.checkpoint_config
        due = bool(self._manager) and (
            (cfg.interval_steps and self.step % cfg.interval_steps == 0)
            or (cfg.interval_s and time.monotonic() - self._last_periodic >= cfg.interval_s))
        flags = torch.tensor([int(self._local_request()), int(bool(due))], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        stop, periodic = proto.StopReason(int(flags[0])), bool(flags[1])
        if stop is not proto.StopReason.NONE:
            self._stop(stop)
        if periodic:
            self._last_periodic = time.monotonic()
            self._save("periodic")

    def _stop(self, why: proto.StopReason) -> None:
        kind = why.checkpoint_kind.value
        deadline = self._link.deadline if self._link else None
        self._log.warning("worker_stopping", step=self.step, kind=kind,
                          deadline_in_s=round(deadline - time.time(), 1) if deadline else None)
        report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False)
        if self._manager is not None:
            try:
                seconds = self._save(kind)
                committed = self._manager.wait()
                self._log.info("checkpoint_committed", step=committed, kind=kind, seconds=round(seconds, 3),
                               before_deadline=deadline is None or time.time() <= deadline)
                report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, seconds=round(seconds, 3),
                                         last_committed=committed)
            except Exception as e:  # the last committed checkpoint stands; say how much work that loses
                last = None
                try:
                    last = self._manager.latest()
                except CheckpointError as e2:
                    self._log.warning("checkpoint_latest_unknown", error=str(e2)[:500])
                self._metrics.observe_checkpoint(kind, None, None, 0.0, 0, self.step, False)
                self._log.error("checkpoint_failed", step=self.step, kind=kind, error=str(e)[:500], last_committed=last,
                                lost_steps=self.step - (last or 0))
                report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False,
                                         last_committed=last)
        if self._link is not None:
            self._link.committed(report)
        if self._manager is not None:
            self._manager.close()
        if self._link is not None:
            self._link.close()
        # The checkpoint is committed on every rank: leave at once. A clean interpreter teardown with
        # gloo/torch takes seconds that a drain deadline should not pay for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(proto.EXIT_RESIZE)

    def finish(self, barrier: bool = True) -> None:
        """Wait for an in-flight save, close the agent link and the process group."""
        if self._manager is not None:
            self._manager.close()
        if self._link is not None:
            self._link.close()
        if self.strategy is not None:
            self.strategy.teardown()
        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
