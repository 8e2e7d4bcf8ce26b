"""The tiny job on Ray Train (2.60, its V2 API): ``TorchTrainer`` over a local Ray cluster of one raylet per
"node", ``ScalingConfig(use_gpu=False)`` with one CPU worker per node, ``FailureConfig(max_failures=...)``,
a ``ray.train`` checkpoint (rank 0's ``torch.save`` of model and optimizer) every ``--ckpt-every`` steps,
restored from ``ray.train.get_checkpoint()`` when Ray restarts the worker group.

Two roles, one script (``bench/peers.py``'s ``RayPeer``):

* ``--role head`` is node a: it starts the head raylet (GCS included) as its own child, ``ray start --head
  --block`` on 127.0.0.1 with a temp folder of its own, connects to it as the driver, runs ``fit()`` and
  stops the head at the end. Killing node a's process tree takes the head with it.
* ``--role node`` is node b or c: it waits for the head's GCS port, then becomes ``ray start --address ...
  --block`` (a second, real raylet on loopback), so a node fault hits a Ray node, not a process inside one.

Every node has ``--num-cpus 1`` and every worker asks for one CPU, so the two workers of a world of 2 sit one
per node. ``--workers N`` is a fixed world; ``--workers MIN:MAX`` Ray's elastic world (it restarts the
group at the size the cluster allows, and looks to grow it every ``--resize-every`` s). Ray's own timeouts
come from the environment (``RAY_TRAIN_*``, ``RAY_health_check_*``), as the bench's rows set them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import common


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _ports() -> list[str]:
    """Ports of the raylet's helpers that default to fixed numbers (two raylets on one host would collide)."""
    out = []
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out += [flag, str(s.getsockname()[1])]
    return out


def _start_args(temp_dir: str) -> list[str]:
    return ["--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir,
            "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats", *_ports()]


def _wait_port(address: str, timeout: float) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"ray_job.py: the head's GCS at {address} did not answer within {timeout:.0f} s")


def train_loop(config: dict) -> None:
    """One Ray Train worker: the same loop as ``torchrun_job.py``; DDP through ``prepare_model``."""
    import torch
    import torch.distributed as dist

    import ray.train
    import ray.train.torch

    common.setup_torch()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    data = common.dataset()
    model = common.model()
    opt = common.optimizer(model)
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as folder:
            state = torch.load(os.path.join(folder, "ckpt.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    gen = step  # a (re)started group is named by the step it resumed from; its processes are new anyway
    model = ray.train.torch.prepare_model(model)
    while step < config["steps"]:
        step += 1
        ids = common.global_batch(step)[rank::world]
        opt.zero_grad(set_to_none=True)
        common.loss_of(model, data, ids).backward()
        opt.step()
        time.sleep(config["step_sleep"])
        common.log_step(config["step_log"], step, rank, world, gen, ids)
        if step % config["ckpt_every"] == 0:
            # Every rank reports (a collective in Ray Train); rank 0 alone attaches the checkpoint.
            with tempfile.TemporaryDirectory() as folder:
                checkpoint = None
                if rank == 0:
                    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
                    torch.save({"model": inner.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(folder, "ckpt.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(folder)
                ray.train.report({"step": step}, checkpoint=checkpoint)
    if dist.is_initialized():
        dist.barrier()


def head(args) -> int:
    head_log = open(os.path.join(os.path.dirname(args.step_log), "head-raylet.log"), "w")
    cmd = [_ray_cli(), "start", "--head", "--port", args.address.rsplit(":", 1)[1], "--include-dashboard", "false",
           *_start_args(args.temp_dir)]
    # A session of its own: ray start --block's reaper SIGTERMs its whole process group when it ends, which
    # would otherwise include this driver.
    raylet = subprocess.Popen(cmd, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(args.address, 120)
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        ray.init(address=args.address, log_to_driver=False)
        lo, _, hi = args.workers.partition(":")
        num_workers = (int(lo), int(hi)) if hi else int(lo)
        scaling = ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1},
                                **({"elastic_resize_monitor_interval_s": args.resize_every} if hi else {}))
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"steps": args.steps, "step_sleep": args.step_sleep, "ckpt_every": args.ckpt_every,
                               "step_log": args.step_log},
            scaling_config=scaling,
            run_config=RunConfig(name="peers", storage_path=os.path.join(os.path.dirname(args.step_log), "ray-results"),
                                 failure_config=FailureConfig(max_failures=args.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)))
        result = trainer.fit()
        print(f"ray_job.py: fit() ended: error {result.error!r}", flush=True)
        ray.shutdown()
        return 0 if result.error is None else 1
    finally:
        raylet.send_signal(signal.SIGTERM)  # ray start --block stops the head's processes on SIGTERM
        try:
            raylet.wait(30)
        except subprocess.TimeoutExpired:
            raylet.kill()


def node(args) -> int:
    _wait_port(args.address, 180)
    cmd = [_ray_cli(), "start", "--address", args.address, *_start_args(args.temp_dir)]
    os.execv(cmd[0], cmd)
    return 1


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--role", choices=("head", "node"), required=True)
    p.add_argument("--address", required=True, help="the head's GCS, 127.0.0.1:PORT")
    p.add_argument("--temp-dir", required=True, help="Ray's temp folder for this run (short: it holds sockets)")
    p.add_argument("--workers", default="2", help="N (fixed) or MIN:MAX (Ray's elastic training)")
    p.add_argument("--resize-every", type=float, default=60.0, help="elastic_resize_monitor_interval_s")
    p.add_argument("--max-failures", type=int, default=5, help="FailureConfig(max_failures)")
    args = p.parse_args()
    return head(args) if args.role == "head" else node(args)


if __name__ == "__main__":
    sys.exit(main())
