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
    rt.finish()                                               # saves the last step (kind "final"), closes

**Strategy.** How model and optimizer are spread over the ranks (DDP, FSDP2, ...) is a
:class:`~trainguard.strategies.base.Strategy`, chosen by name or passed built. The runtime only uses
its interface: ``setup`` wraps, ``no_sync`` drives accumulation, ``state`` is the model/optimizer entry
of the checkpoint, ``data_parallel`` says which ranks share a part of the batch, ``plan`` splits the
global batch, and ``name`` goes into the manifest. With the
32-bit precision ``rt.autocast()``/``rt.backward()``/``rt.optimizer_step()`` are plain
``nullcontext``/``loss.backward()``/``opt.step()``, so scripts that call those directly keep working.

**Agreement at a step boundary.** ``end_step`` all-reduces (MAX) each rank's
:class:`~trainguard.runtime.boundary.Flags` over a side gloo group: its stop request (a
:class:`~trainguard.contract.protocol.StopReason`: a drain or a resize its agent pushed over the control
socket, or SIGTERM under plain torchrun), the save it asks for (periodic when due, out of cycle when
some node's agent asked for one: an early warning), its drain deadline, whether a previous save still
persists, which agreement it is configured with (``workers.step_agreement``), its ``stride``
and its tier-0 snapshot interval proposal (``checkpoint.memory_max_overhead``; the world takes the
largest). Every rank therefore sees the same flags after the same step, and
:func:`~trainguard.runtime.boundary.decide_boundary` (pure) says what follows: all of them save the
same step ``s``, rank 0 commits it, and on a stop all exit with
:data:`~trainguard.contract.protocol.EXIT_RESIZE`. The new world restores ``s`` and continues at
``s + 1``. How and when the flags are exchanged (overlapped or blocking, every ``stride`` steps) is
:mod:`~trainguard.runtime.agreement`.

**Data.** A :class:`~trainguard.runtime.cursor.GlobalSampleCursor` (seeded permutation per epoch,
samples consumed) is part of the checkpoint; each global batch is split over the current
data-parallel ranks (all ranks, unless the strategy groups them: ``model_parallel``'s tensor-parallel
groups share one part) and the global batch stays constant by adapting gradient accumulation.

**In-place re-formation** (``workers.reform: in-process``, the default under the agent). A worker
that survives a membership change does not exit: at the agreed step it commits the emergency
checkpoint if a node drains (durability; the node that leaves exits), tears its process groups down,
reports :class:`~trainguard.contract.protocol.Parked` and waits for the agent's
:class:`~trainguard.contract.protocol.Reform`. It then builds the new world's groups, re-wraps the model
(:meth:`Strategy.reform`), recomputes its batch plan, and the ranks that lack the state (a joiner, a
restarted worker) receive it from a live peer (:mod:`~trainguard.runtime.reformation`).
``end_step`` returns and the loop goes on with the next step: same process, same model and optimizer
objects. A collective that fails because a peer vanished (inside ``rt.accumulating``, ``rt.backward``,
``rt.optimizer_step`` or ``rt.end_step``) is caught: the interrupted step is rolled back (its samples
come again) and the worker parks the same way. Anything else that fails there exits the worker with
the resize code, and the agent restarts the world (the fallback). Strategies whose state cannot be
handed over in memory (``Strategy.reform_state`` is ``RESTART``) always take the fallback.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.state import TrainerState
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger
from trainguard.runtime import device as dev
from trainguard.runtime import reform as rf
from trainguard.runtime.agreement import StepAgreement
from trainguard.runtime.boundary import BoundaryAct, Flags, SaveAsk, decide_boundary
from trainguard.runtime.cursor import GlobalSampleCursor
from trainguard.runtime.faults import FaultHooks
from trainguard.runtime.finishing import Finishing
from trainguard.runtime.liveness import _PHASE_OF_STATE, Liveness
from trainguard.runtime.pace import PaceMeter
from trainguard.runtime.reformation import PARITY_ABANDON_S, Reformation
from trainguard.runtime.session import AgentSession
from trainguard.runtime.state import TRANSITIONS, WorkerState
from trainguard.runtime.tiers import CheckpointTiers, SaveAbandoned
from trainguard.strategies.base import ReformState, Strategy, get_strategy
from trainguard.strategies.batch import split

log = get_logger("trainguard.worker")

_GLOO_DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout for gloo (when pg_timeout_s is 0)




def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


class Runtime(Liveness, Finishing):
    """One worker's link to trainguard. Not thread-safe: the training loop owns it."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, job_id: str, checkpoint: CheckpointConfig,
                 control_path: str = "", strategy: str | Strategy = "ddp", rdzv_id: str = "", rdzv_round: int = -1,
                 reform: bool = False, reform_timeout_s: float = 120.0, pg_timeout_s: float = 0.0,
                 standby: bool = False, local_world_size: int = 1, inject_fault: str = "",
                 device: torch.device | None = None, memory_dir: str = "", step_agreement: str = "overlapped",
                 step_agreement_period_s: float = 0.0, progress_interval_s: float = 0.0) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = dev.select_device(local_rank) if device is None else torch.device(device)
        """This worker's device: ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``. Move the
        model (or build it there) and every batch to it; the strategy, checkpoint staging, barriers and
        metrics all use it (see :mod:`trainguard.runtime.device`)."""
        self.local_world_size = local_world_size
        # The rendezvous only labels the checkpoint epoch this world claims (fencing uses epochs).
        self.job_id, self.rdzv_id = job_id, rdzv_id
        self.round = rdzv_round
        """The rendezvous round of the current world (information: checkpoints are fenced by epochs)."""
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
        self.global_batch = 0
        self.tokens_per_sample = 0
        self.reform_enabled = reform
        self.reform_timeout_s = reform_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.reformations = 0
        """How many times this process re-formed in place."""
        self.current_batch: list[int] = []
        """Sample ids of the whole global batch of the step in progress (all ranks' shares)."""
        self.worker_state = WorkerState.STANDBY if standby else WorkerState.RUNNING
        """Where this worker is (:class:`~trainguard.runtime.state.WorkerState`: its transitions)."""
        self._faults = FaultHooks(inject_fault)
        self._stepped = False
        self._cursor_at_step_start: dict[str, Any] | None = None
        self._signal_request = proto.StopReason.NONE
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._trainer = TrainerState()
        self._timer = dev.StepTimer(self.device)
        self._pace = PaceMeter()
        """This rank's local compute per step (the straggler detector's input, reported to the agent)."""
        self._sync_micro = True  # a script without rt.accumulating synchronises in every backward
        self.inflight_timeout_s = (pg_timeout_s or _GLOO_DEFAULT_TIMEOUT_S) + checkpoint.retry_deadline_s
        """Bound of waiting for the previous background save: its collectives are bounded by the process
        groups' timeout, its storage operations by ``checkpoint.retry_deadline_s``."""
        self._group = self._new_gloo_group() if (world_size > 1 or reform) and dist.is_initialized() else None
        self._agreement = StepAgreement(step_agreement, step_agreement_period_s)
        """The step-boundary flags exchanged over ``_group`` (issue/await, stride)."""
        self._agreement.bind(self._group)
        self._metrics: Any = None
        self._session = AgentSession(control_path, rank, local_rank)
        """The agent link, SIGTERM, the reports and the one exit."""
        self._progress = self._start_progress(progress_interval_s)
        """The progress heartbeat to the agent (hang detection), or None without an agent."""
        self._tiers = CheckpointTiers(self, memory_dir)
        """The checkpoint tiers of this world: durable manager, memory tier, replicas/parity, interval."""
        self._reform = Reformation(self)
        """Park, join the next world, hand the live state over (in-place re-formation)."""
        self._log = log.bind(rank=rank, world_size=world_size, round=rdzv_round)
        if reform and not self._session.linked:
            self.reform_enabled = False  # in-place re-formation needs an agent to re-form the rendezvous

    # ---- construction -------------------------------------------------------------------------
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

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Runtime:
        """Initialise the process group from the torchelastic env (gloo on CPU, NCCL on GPU) and read
        the agent's :class:`~trainguard.contract.protocol.RuntimeEnv`. Works under plain torchrun and alone too.

        A standby worker (a joiner warming up before its world exists) makes no process group here:
        :meth:`setup` waits for the agent's :class:`~trainguard.contract.protocol.Reform` first."""
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
        return cls(rank=rank, world_size=rtenv.world_size, local_rank=rtenv.local_rank,
                   job_id=rtenv.job_id or rtenv.run_id or "trainguard", rdzv_id=rtenv.run_id,
                   rdzv_round=rtenv.round, checkpoint=CheckpointConfig(**rtenv.checkpoint),
                   control_path=rtenv.control_path, reform=reform, reform_timeout_s=rtenv.reform_timeout_s,
                   pg_timeout_s=rtenv.pg_timeout_s, standby=rtenv.standby, local_world_size=rtenv.local_world_size,
                   inject_fault=rtenv.inject_fault, device=device, memory_dir=rtenv.memory_dir,
                   step_agreement=rtenv.step_agreement, step_agreement_period_s=rtenv.step_agreement_period_s,
                   progress_interval_s=rtenv.progress_interval_s)

    @property
    def step_agreement(self) -> str:
        """``workers.step_agreement``: ``overlapped`` or ``blocking`` (see :mod:`~trainguard.runtime.agreement`)."""
        return self._agreement.mode

    @property
    def step_agreement_period_s(self) -> float:
        """``workers.step_agreement_period_s`` (see :mod:`~trainguard.runtime.agreement`)."""
        return self._agreement.period_s

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
        self.strategy.device = self.device  # the strategy never guesses it from where the model sits
        if self.reform_enabled and self.strategy.reform_state is ReformState.RESTART:
            self._log.info("reform_in_place_unsupported", strategy=self.strategy.name,
                           effect="membership changes restart the workers (the fallback path)")
            self.reform_enabled = False
        self.strategy.keep_wrapped = self.reform_enabled
        if self.worker_state is WorkerState.STANDBY:
            self._reform.wait_for_first_world()
        self.micro_batch = micro_batch
        self.global_batch = global_batch
        self._data_parallel()
        self.accum_steps, _ = self.strategy.plan(global_batch, self.dp_size, micro_batch)
        self.tokens_per_sample = tokens_per_sample
        self.cursor = GlobalSampleCursor(dataset_size, global_batch, seed)
        from trainguard.metrics import WorkerMetrics

        # A no-op (one warning) when the agent set up no metrics channel, e.g. under plain torchrun.
        self._metrics = WorkerMetrics(self.rank, self.local_rank, device=self.device, gpu=dev.gpu_label(self.device))
        with self._group_connections():  # a strategy's device-mesh sub-groups (model_parallel's dp and tp)
            self._model, self._optimizer = self.strategy.setup(model, optimizer)
        self._step_started = time.monotonic()
        self._timer.start()
        self._trainer = TrainerState(seed=seed,
                                     config_fingerprint=f"gb={global_batch},n={dataset_size},seed={seed}")
        self._tiers.make_manager()
        if self._tiers.manager is not None and self.rank <= 0 and self._tiers.memory_dir:  # what tier 0/1 leave out, once
            if not self._tiers.tier0_wanted:
                self._log.info("memory_tier_redundant", strategy=self.strategy.name,
                               effect="no in-memory snapshots: the state is replicated and re-forms in place, a lost "
                                      "worker or node is restored from a live peer "
                                      "(checkpoint.memory_replicated_in_place: true takes them anyway)")
            elif self.checkpoint_config.memory_replica and not self._tiers.replicas_wanted:
                self._log.info("memory_replica_redundant", strategy=self.strategy.name,
                               effect="no buddy replicas: the state is replicated, every node's own snapshots "
                                      "restore any rank (tier 0 alone outlives a lost node)")
        if self._tiers.manager is None and self.rank <= 0:
            self._log.warning("checkpoint_url_unset", effect="no checkpoint is saved: a drain, resize or crash loses "
                              "the work since the start, and finish() saves nothing",
                              fix="set checkpoint.url (TRAINGUARD_CHECKPOINT_URL) for the agent or torchrun")
        self._log.info("worker_setup", accum_steps=self.accum_steps, micro_batch=micro_batch, global_batch=global_batch,
                       checkpoints=self._tiers.manager.url if self._tiers.manager else None, agent_link=self._session.linked,
                       reform_in_place=self.reform_enabled, resize_rule=self.strategy.resize_rule,
                       **self.strategy.describe())
        return self._model, self._optimizer

    def _data_parallel(self) -> None:
        """This rank's data-parallel share at the current world (the batch is split over the shares; the
        ranks of one share, e.g. a TP group, get the same samples; the first of them counts them)."""
        assert self.strategy is not None
        shares = [self.strategy.data_parallel(r, self.world_size)[0] for r in range(self.world_size)]
        self.dp_rank, self.dp_size = self.strategy.data_parallel(self.rank, self.world_size)
        self._counts_samples = shares.index(self.dp_rank) == self.rank

    # ---- checkpoints ----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        assert self._model is not None and self.cursor is not None and self.strategy is not None, "setup() first"
        self._trainer.step = self.step
        self._trainer.cursor = self.cursor.state_dict()
        if self._tiers.interval is not None:
            self._tiers.interval.tick()
            self._trainer.extras["interval"] = self._tiers.interval.stats.to_dict()
        return {"app": self.strategy.state(self._model, self._optimizer), "trainer": self._trainer}

    def restore(self, step: int | None = None) -> int:
        """Load the newest committed checkpoint (or the committed ``step``), saved at any world size,
        and return the step to continue from.

        When this worker joins a world re-formed in place, the state comes from a live peer instead
        (newer than any checkpoint, and no storage read)."""
        with self._phase(proto.Phase.RESTORE):
            self._tiers.settle()
            if self.reform_enabled and step is None and self._group is not None:
                outcome, live = self._reform.sync_live_state(None)
                if outcome != "none":
                    self._log.info("worker_restored", step=self.step, source="peer", live_step=live)
                    return self.step
            return self._tiers.restore(step)

    # ---- the step -------------------------------------------------------------------------------
    def next_batches(self) -> list[list[int]]:
        """This rank's share of the next global batch, as ``accum_steps`` lists of sample ids."""
        assert self.cursor is not None, "setup() first"
        self._cursor_at_step_start = self.cursor.state_dict()
        ids = self.cursor.next_global_batch()
        self.current_batch = ids
        return split(ids, self.dp_rank, self.dp_size, self.micro_batch)

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """Skip the strategy's gradient synchronisation on all but the last micro-batch of a step.

        In-place mode: a collective that fails inside because a peer vanished is swallowed here and
        the step is rolled back at :meth:`end_step`."""
        assert self.strategy is not None and self._model is not None, "setup() first"
        # A step made void already skips the sync; its forward may still run a collective that fails.
        sync = contextlib.nullcontext() if self.worker_state is WorkerState.BROKEN else self.strategy.no_sync(self._model, last)
        self._sync_micro = last  # its backward synchronises the gradients: time blocked on peers (runtime/pace.py)
        try:
            with sync:
                yield
        except Exception as e:
            if not self._peer_failed(e):
                raise

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The precision's context for forward + loss (a no-op at 32-bit)."""
        assert self.strategy is not None, "setup() first"
        return self.strategy.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when the precision uses a loss scaler (``16-mixed``)."""
        assert self.strategy is not None, "setup() first"
        if self.worker_state is WorkerState.BROKEN:
            return
        t0 = time.monotonic()
        try:
            self.strategy.backward(loss)
        except Exception as e:
            if not self._peer_failed(e):
                raise
        finally:
            if self._sync_micro:
                self._pace.blocked(time.monotonic() - t0)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """``optimizer.step()`` (the one ``setup`` returned by default); with a loss scaler it unscales,
        skips the step on inf/nan gradients (on every rank alike) and updates the scale. Skipped when
        a peer vanished during this step (the step is redone in the re-formed world)."""
        assert self.strategy is not None and self._optimizer is not None, "setup() first"
        if self.worker_state is WorkerState.BROKEN:
            return
        self._tiers.settle()  # a snapshot may still be copying the parameters this step changes
        try:
            self.strategy.optimizer_step(optimizer or self._optimizer)
            self._stepped = True
        except Exception as e:
            if not self._peer_failed(e):
                raise

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """All-reduce ``tensor`` in place over the current world (``op``: ``mean``, ``sum`` or ``max``),
        e.g. the loss for a log line. In-place mode: a vanished peer leaves it unchanged and is handled
        at :meth:`end_step` like a failure in the step itself."""
        if self.world_size == 1 or not dist.is_initialized() or self.worker_state is WorkerState.BROKEN:
            return tensor
        red = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        # The default group runs on rt.device (NCCL takes GPU tensors only): a tensor elsewhere travels there.
        work = tensor if tensor.device == self.device else tensor.to(self.device)
        t0 = time.monotonic()
        try:
            dist.all_reduce(work, op=red)
        except Exception as e:
            if not self._peer_failed(e):
                raise
            return tensor
        finally:
            self._pace.blocked(time.monotonic() - t0)
        if op == "mean":
            work /= self.world_size
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def _enter(self, state: WorkerState) -> None:
        """Move to ``state`` (one of :data:`~trainguard.runtime.state.TRANSITIONS`; another is logged)."""
        if (self.worker_state, state) not in TRANSITIONS:
            self._log.warning("worker_state_unexpected", state=self.worker_state.value, to=state.value)
        self.worker_state = state
        if getattr(self, "_progress", None) is not None:  # between worlds is no hang (bounded by workers.reform_timeout_s)
            self._progress.set_phase(_PHASE_OF_STATE.get(state, proto.Phase.STEP))

    def _peer_failed(self, e: BaseException) -> bool:
        """Record a collective failure caused by a vanished peer (in-place mode); False for anything else."""
        if not (self.reform_enabled and rf.is_peer_failure(e)):
            return False
        if self.worker_state is not WorkerState.BROKEN:
            self._enter(WorkerState.BROKEN)
            self._log.warning("peer_lost", step=self.step + 1, error=str(e)[:300])
        return True

    def end_step(self) -> bool:
        """Call after ``optimizer.step()``: counts the step, agrees with every rank on drain/resize and
        periodic checkpoints, saves, and exits with code 75 after an emergency/resize checkpoint (or,
        re-forming in place, continues in the new world). Returns whether the step counted: False when
        a vanished peer interrupted it and the new world redoes it (with the same samples). A rank whose
        own optimizer step failed still gets True when another survivor finished that step: the new
        world continues from the newest live state, so the step counted for the job."""
        assert self.cursor is not None, "setup() first"
        stepped, self._stepped = self._stepped, False
        if self.worker_state is WorkerState.BROKEN:
            attempted = self.step + 1
            if stepped:  # the optimizer step ran on this rank: the step happened; the new world agrees
                self.step += 1
                self._reform.park(proto.ParkReason.PEER_LOST)
                return True
            self._roll_back_step()
            self._pace.discard_step()
            self._reform.park(proto.ParkReason.PEER_LOST)
            # The survivors agree on the newest live state (sync_live_state): a peer whose all-reduce
            # completed before the failure handed the finished step over, and it is not redone.
            if self.step < attempted:
                return False
            self._log.info("step_handed_over", step=attempted, reason="a survivor finished it before the failure")
            return True
        self.step += 1
        now = time.monotonic()
        step_s = now - self._step_started  # the step itself: what end_step does next is not part of it
        if self._tiers.manager is not None and not self._tiers.staging_ready:
            # After the first step the optimizer state exists: allocate the staging buffers now, so that
            # the first save (perhaps an emergency one, against a deadline) does not pay for them.
            self._tiers.staging_ready = True
            self._tiers.manager.prepare_staging(self._state())
        # Between two agreements nothing is exchanged or acted on; the step-time histogram waits in the process.
        between = self._agreement.between(self.step)
        # One rank per data-parallel share counts its samples, so the job's sum is the global batch.
        per_rank = self.cursor.global_batch_size // self.dp_size if self._counts_samples else 0
        if self._timer.cuda:  # host time says when work was queued: the GPU's events time the steps it finished
            self._metrics.observe_step(self.step, per_rank, per_rank * self.tokens_per_sample, None, defer=True)
            for seconds in self._timer.lap():
                self._metrics.observe_step_time(seconds, defer=True)
        else:
            self._metrics.observe_step(self.step, per_rank, per_rank * self.tokens_per_sample, step_s, defer=True)
        if not between:
            self._metrics.flush()
        self._metrics.sample_gpu_peak(now)
        self._agreement.observe_step(step_s)
        self._pace.step_done(self.step, step_s)
        if self._tiers.interval is not None and self._tiers.manager is not None:
            self._tiers.interval.observe_step(step_s, persisting=self._tiers.manager.in_flight is not None)
        if between:
            self._tiers.snapshot()
            self._step_started = time.monotonic()
            return True
        # Overlapped: the exchange issued at the previous boundary has run beside the steps since; read
        # it and act on it here, then issue this boundary's for the next one. Blocking, and the first
        # boundary of a world (nothing issued yet): exchange now and wait.
        try:
            with self._phase(proto.Phase.AGREEMENT):
                agreed, mine = self._agreement.await_flags(lambda ahead: self._local_flags(now, ahead))
        except Exception as e:
            if not self._peer_failed(e):
                raise
            self._reform.park(proto.ParkReason.PEER_LOST)  # the step itself completed on every survivor
            return True
        if not self._act(agreed, mine):
            return True
        pace = self._pace.report(self.rank, self.local_rank)
        if pace is not None:
            self._session.report(pace)
        if self._agreement.overlapped:  # for the next multiple of the agreed stride
            self._agreement.issue(self.step, lambda ahead: self._local_flags(time.monotonic(), ahead))
        self._step_started = time.monotonic()
        return True

    def _local_flags(self, now: float, ahead: int) -> tuple[Flags, proto.StopReason]:
        """This rank's side of the step-boundary agreement (:class:`~trainguard.runtime.boundary.Flags`)
        and its own stop request in it. ``ahead``: the agreement is
        acted on that many steps later (a periodic save is asked for the step it will be taken at)."""
        due = (self._tiers.interval_step(now, ahead) if self._tiers.interval is not None and self._tiers.manager is not None
               else False)
        notice = self._session.take_checkpoint() if self._tiers.manager is not None else None
        if notice is not None:
            self._log.info("checkpoint_requested", step=self.step + ahead, reason=notice)
        due = due or self._tiers.save_deferred
        mine = self._session.request()
        # A save started at this very boundary counts only when the flags are acted on at the next step;
        # acted on ``ahead`` > 1 steps later (a stride), it has those steps to persist, and counting it
        # would defer every other save of an interval as short as the stride.
        inflight = self._tiers.manager.in_flight if self._tiers.manager is not None else None
        overlapped = self.step_agreement == "overlapped"
        every = self._tiers.interval.policy.steps if self._tiers.interval is not None and self._tiers.manager is not None else 0
        flags = Flags(stop=mine, save=SaveAsk.NOTICE if notice is not None else SaveAsk(int(bool(due))),
                      deadline=self._session.deadline(), busy=inflight is not None and (ahead <= 1 or inflight < self.step),
                      overlapped=overlapped, blocking=not overlapped, stride=self._agreement.stride_proposal(every),
                      memory_every=self._tiers.memory_proposal())
        return flags, mine

    def _act(self, agreed: Flags, mine: proto.StopReason) -> bool:
        """Carry out what every rank agreed (the MAX of the flags) at this boundary, as
        :func:`~trainguard.runtime.boundary.decide_boundary` decides: stop or re-form, then the snapshot
        and the save. ``mine``: this rank's own stop request in that agreement. False when this worker
        parked (and re-formed) meanwhile: the step is over for the caller."""
        assert self.strategy is not None
        d = decide_boundary(agreed, mine=mine, reform_in_place=self.reform_enabled, reform_state=self.strategy.reform_state,
                            defer_when_busy=self.checkpoint_config.when_busy == "defer",
                            save_deferred=self._tiers.save_deferred, mixed=self._agreement.mixed)
        self._agreement.stride = d.stride
        if agreed.memory_every != self._tiers.memory_every and self._tiers.memory is not None:
            self._log.info("memory_interval_changed", step=self.step, interval_steps=agreed.memory_every,
                           before=self._tiers.memory_every, snapshot_ms=_ms(self._tiers.snapshot_mean_s),
                           step_ms=_ms(self._agreement.step_mean_s),
                           max_overhead=self.checkpoint_config.memory_max_overhead)
        self._tiers.memory_every = d.memory_every
        if d.mixed and not self._agreement.mixed:
            self._agreement.mixed = True
            self._log.warning("step_agreement_mixed", step=self.step, configured=self.step_agreement,
                              effect="this world agrees blocking; set workers.step_agreement alike on every node")
        if d.save_deferred and not self._tiers.save_deferred:
            self._log.info("checkpoint_deferred", step=self.step, reason="the previous save is still persisting")
        self._tiers.save_deferred = d.save_deferred
        if d.act is BoundaryAct.SURVIVE:
            # The re-formation itself saves nothing where the state is handed over in memory: the periodic
            # save agreed here is taken first, so that the step the new world continues from is durable.
            if d.save and not self._periodic_save(d.save):
                return False  # a peer vanished during it: re-formed already
            self._survive(d.stop, d.deadline)  # this node stays: park and re-form in place
            return False
        if d.act is BoundaryAct.STOP:
            self._stop(d.stop, d.deadline)  # exits with the resize code
        self._tiers.snapshot()
        if d.save:
            return self._periodic_save(d.save)
        return True

    def _periodic_save(self, save: SaveAsk) -> bool:
        """The periodic or out-of-cycle (notice) checkpoint agreed at this step.
        False when a peer vanished during it (this worker parked and re-formed meanwhile)."""
        if self._tiers.interval is not None:
            self._tiers.interval.saved()
        try:
            with self._phase(proto.Phase.SAVE):
                self._tiers.save(proto.CheckpointKind.NOTICE.value if save is SaveAsk.NOTICE else proto.CheckpointKind.PERIODIC.value)
        except Exception as e:  # staging gathers over the ranks: a peer may vanish right here
            if not self._peer_failed(e):
                raise
            self._reform.park(proto.ParkReason.PEER_LOST)
            return False
        return True

    def _roll_back_step(self) -> None:
        assert self.cursor is not None and self._optimizer is not None
        if self._cursor_at_step_start is not None:
            self.cursor.load_state_dict(self._cursor_at_step_start)
        self._optimizer.zero_grad(set_to_none=True)
        self._log.warning("step_rolled_back", step=self.step + 1, reason="peer_lost")

    # ---- in-place re-formation ------------------------------------------------------------------
    def _survive(self, why: proto.StopReason, deadline: float | None = None) -> None:
        """A peer drains or a node joins: commit what durability needs, then park for the new world.
        A save still running at the drain ``deadline`` is abandoned (see :meth:`CheckpointTiers.save_by`): the worker
        exits with the resize code and the world restarts from the last commit."""
        kind = why.checkpoint_kind.value
        assert self.strategy is not None
        need_checkpoint = why is proto.StopReason.DRAIN or self.strategy.reform_state is ReformState.CHECKPOINT
        if self._tiers.manager is not None and need_checkpoint:
            try:
                with self._phase(proto.Phase.SAVE):
                    seconds, result, committed = self._tiers.save_by(kind, deadline)
            except SaveAbandoned as e:
                self._abandon(why, e)
            self._log.info("checkpoint_committed", step=committed, kind=kind, seconds=round(seconds, 3),
                           before_deadline=deadline is None or time.time() <= deadline)
            self._session.report(self._session.committed(self.step, self.rank, why.checkpoint_kind, seconds, result, committed))
        self._reform.park(proto.ParkReason.DRAIN if why is proto.StopReason.DRAIN else proto.ParkReason.RESIZE)

    def _abandon(self, why: proto.StopReason, e: SaveAbandoned) -> None:
        """The deadline passed mid-save: the last committed checkpoint stands. Say how much work that
        loses, tell the agent, and exit with the resize code (no cleanup: a thread may be stuck in a
        collective with a vanished peer, and closing the manager would wait for it)."""
        last = self._tiers.committed
        self._metrics.observe_checkpoint(why.checkpoint_kind.value, None, None, 0.0, 0, self.step, False)
        self._log.error("checkpoint_abandoned", step=self.step, kind=why.checkpoint_kind.value, reason=str(e),
                        last_committed=last, lost_steps=self.step - (last or 0),
                        effect="exiting with the resize code; the job resumes from the last committed step")
        self._session.report(proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False,
                                              last_committed=last, error=str(e)[:500]))
        self._exit(proto.EXIT_RESIZE)

    def _stop(self, why: proto.StopReason, deadline: float | None = None) -> None:
        kind = why.checkpoint_kind.value
        self._log.warning("worker_stopping", step=self.step, kind=kind,
                          deadline_in_s=round(deadline - time.time(), 1) if deadline else None)
        report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False)
        if self._tiers.manager is None:
            self._metrics.observe_checkpoint(kind, None, None, 0.0, 0, self.step, False)
            self._log.warning("checkpoint_not_saved", step=self.step, kind=kind, reason="checkpoint.url is not set",
                              effect="the next start begins from step 0")
        else:
            try:
                with self._phase(proto.Phase.SAVE):
                    seconds, result, committed = self._tiers.save_by(kind, deadline)
                self._log.info("checkpoint_committed", step=committed, kind=kind, seconds=round(seconds, 3),
                               before_deadline=deadline is None or time.time() <= deadline)
                report = self._session.committed(self.step, self.rank, why.checkpoint_kind, seconds, result, committed)
            except SaveAbandoned as e:
                self._abandon(why, e)
            except Exception as e:  # the last committed checkpoint stands; say how much work that loses
                last = self._tiers.committed  # local knowledge: asking rank 0 is a collective, and a peer may be gone
                self._metrics.observe_checkpoint(kind, None, None, self._tiers.manager.last_blocked_s, 0, self.step, False)
                self._log.error("checkpoint_failed", step=self.step, kind=kind, error=str(e)[:500], last_committed=last,
                                lost_steps=self.step - (last or 0))
                report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False,
                                         last_committed=last, error=f"{type(e).__name__}: {e}"[:500])
        self._session.report(report)
        if self._tiers.manager is not None:
            self._tiers.manager.close()
        self._exit(proto.EXIT_RESIZE)

    def _exit(self, code: int) -> None:
        """The last local work, then :meth:`AgentSession.exit` (the process ends with ``code``)."""
        if self._tiers.memory is not None and self._tiers.memory.parity:
            self._tiers.memory.abandon(PARITY_ABANDON_S)  # a snapshot past its parity agreement finishes its local write
        if self._metrics is not None:
            self._metrics.flush()
        self._session.exit(code)
