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
from trainguard.runtime.cursor import GlobalSampleCursor
from trainguard.runtime.faults import FaultHooks
from trainguard.runtime.finishing import Finishing
from trainguard.runtime.groups import Groups, first_world
from trainguard.runtime.liveness import _PHASE_OF_STATE, Liveness
from trainguard.runtime.pace import PaceMeter
from trainguard.runtime.reformation import Reformation
from trainguard.runtime.session import AgentSession
from trainguard.runtime.stepend import StepEnd
from trainguard.runtime.state import TRANSITIONS, WorkerState
from trainguard.runtime.stopping import Stopping
from trainguard.runtime.tiers import CheckpointTiers
from trainguard.strategies.base import ReformState, Strategy, get_strategy
from trainguard.strategies.batch import split

log = get_logger("trainguard.worker")

_GLOO_DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout for gloo (when pg_timeout_s is 0)


class Runtime(Groups, StepEnd, Stopping, Liveness, Finishing):
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

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Runtime:
        """Initialise the process group from the torchelastic env (gloo on CPU, NCCL on GPU) and read
        the agent's :class:`~trainguard.contract.protocol.RuntimeEnv`. Works under plain torchrun and alone too.

        A standby worker (a joiner warming up before its world exists) makes no process group here:
        :meth:`setup` waits for the agent's :class:`~trainguard.contract.protocol.Reform` first."""
        return cls(**first_world(env))

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
        return self._end_step()

