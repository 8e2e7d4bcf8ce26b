"""The local demo: two trainguard agents on this machine stand in for two spot nodes.

Timeline: both nodes rendezvous and train the bundled GPT job on the worker API (CPU, gloo); node-b
gets a simulated spot notice (``trainguard drain --deadline 30s``, what a cloud watcher does on a real
notice): every rank stops at the same step, the emergency checkpoint is committed, node-b leaves, and
node-a's worker re-forms *in place* at world size 1 (same process, state from memory) and continues
from the next step; node-b comes back, warms its worker up while node-a trains, and the world re-forms
to 2 again; the job finishes. Every event is printed as it happens, with the seconds each change cost
and node-a's worker pid (unchanged).

Run it through ``bash examples/demo.sh`` (installs first) or, in an installed venv,
``python examples/demo.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
T0 = time.monotonic()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(node: str, text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {node:<7} {text}", flush=True)


class Node:
    def __init__(self, name: str, work: str, endpoint: str, train_args: list[str], incarnation: int = 1) -> None:
        self.name, self.work = name, work
        self.log = os.path.join(work, f"{name}-{incarnation}.log")
        self.state_dir = os.path.join(work, f"state-{name}")
        self.offset = 0
        cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "demo", "--node-name", name,
               "--state-dir", self.state_dir, "--log-dir", os.path.join(work, f"logs-{name}"),
               "--set", "agent.log_format=json", "--set", "preemption.sources=signal", "--set", "metrics.port=0",
               "--set", f"checkpoint.url={os.path.join(work, 'ckpt')}", "--set", "checkpoint.interval=50",
               os.path.join(HERE, "train_gpt_elastic.py"), *train_args]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, "OMP_NUM_THREADS": "1"}
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, env=env)
        say(name, f"agent started (pid {self.proc.pid})")

    def new_events(self) -> list[dict]:
        with open(self.log, errors="replace") as fh:
            fh.seek(self.offset)
            data = fh.read()
        cut = data.rfind("\n") + 1
        self.offset += len(data[:cut].encode())
        out = []
        for line in data[:cut].splitlines():
            line = line.split("]:", 1)[-1] if line.startswith("[default") else line
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


def describe(ev: dict) -> str | None:
    e = ev.get("event")
    if e == "rendezvous_complete":
        return f"rendezvous round {ev['round']} complete: world size {ev['world_size']} (this node is group rank {ev['group_rank']})"
    if e == "train_step":
        return f"step {ev['step']:4d}  loss {ev['loss']:.4f}  world size {ev['world_size']}"
    if e == "reformed":
        return (f"worker re-formed in place (pid {ev['pid']}, no restart): continues at step {ev['step'] + 1}, "
                f"world size {ev['world_size']}, gradient accumulation x{ev['accum_steps']}")
    if e == "worker_reformed" and ev.get("rank") == 0:
        return f"  re-formation took {ev['seconds']}s in the worker (state: {ev['state']}, rebuild {ev['rebuild_s']}s)"
    if e == "reformed_in_place":
        return f"  rendezvous re-formed in {ev['rendezvous_s']}s ({ev['reason']}, planned={ev['planned']})"
    if e == "joiner_warm":
        return f"worker warmed up in {ev['seconds']}s (started, imported, model built) before the world pauses for it"
    if e == "resumed":
        return f"workers restored step {ev['step']} and continue at step {ev['step'] + 1} (world size {ev['world_size']}, gradient accumulation x{ev['accum_steps']})"
    if e == "started":
        return f"workers started from scratch (world size {ev['world_size']}, gradient accumulation x{ev['accum_steps']})"
    if e == "checkpoint_committed" and ev.get("component") == "trainguard.worker" and ev.get("rank") == 0:
        return f"{ev['kind']} checkpoint of step {ev['step']} committed in {ev['seconds']}s (before the deadline: {ev['before_deadline']})"
    if e == "checkpoint_committed" and ev.get("component") == "trainguard.checkpoint" and ev.get("rank") == 0 and ev.get("kind") == "periodic":
        return f"periodic async checkpoint of step {ev['step']} committed"
    if e == "state_change":
        extra = f" ({ev['reason']})" if ev.get("reason") else ""
        return f"agent {ev['old']} -> {ev['new']}{extra}"
    if e in ("drain_started", "rendezvous_left", "agent_exit"):
        return e.replace("_", " ") + "".join(f" {k}={ev[k]}" for k in ("source", "exit_code") if k in ev)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--notice-at", type=int, default=150, help="step at which node-b gets its spot notice")
    p.add_argument("--rejoin-after", type=int, default=100, help="steps node-a trains alone before node-b returns")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints)")
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="trainguard-demo-")
    endpoint = f"127.0.0.1:{free_port()}"
    train = ["--steps", str(args.steps), "--global-batch", "24", "--log-every", "25", "--step-sleep", "0.02"]
    print(f"trainguard demo: 2 local nodes, job 'demo', rendezvous {endpoint}, work folder {work}\n", flush=True)
    nodes = {"node-a": Node("node-a", work, endpoint, train)}
    time.sleep(1.0)
    nodes["node-b"] = Node("node-b", work, endpoint, train)
    phase, last_step, alone_from = "together", 0, 0
    pids: set[int] = set()
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            time.sleep(0.3)
            for n in list(nodes.values()):
                for ev in n.new_events():
                    text = describe(ev)
                    if text:
                        say(n.name, text)
                    if ev.get("event") == "reformed" and n.name == "node-a":
                        pids.add(ev["pid"])
                    if ev.get("event") == "train_step":
                        last_step = ev["step"]
                        if phase == "alone" and ev["world_size"] == 1 and not alone_from:
                            alone_from = last_step
            if phase == "together" and last_step >= args.notice_at:
                say("demo", ">>> simulated spot notice for node-b (trainguard drain --deadline 30s)")
                sock = os.path.join(nodes["node-b"].state_dir, "demo.sock")
                subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "drain", "--socket", sock,
                                "--deadline", "30s", "--reason", "spot notice (demo)"], check=True, capture_output=True)
                phase = "alone"
            elif phase == "alone" and alone_from and last_step >= alone_from + args.rejoin_after:
                say("demo", ">>> node-b is back: starting its agent again")
                nodes["node-b"].fh.close()
                nodes["node-b"] = Node("node-b", work, endpoint, train, incarnation=2)
                phase = "rejoined"
            if all(n.proc.poll() is not None for n in nodes.values()) and phase == "rejoined":
                break
        codes = {name: n.proc.wait(30) for name, n in nodes.items()}
        for n in nodes.values():
            for ev in n.new_events():
                if describe(ev):
                    say(n.name, describe(ev))
        ok = all(c == 0 for c in codes.values()) and last_step >= args.steps
        kept = f"node-a's worker process: {sorted(pids)} (the same through every change)" if len(pids) == 1 else \
            f"node-a's worker processes: {sorted(pids)}"
        print(f"\ndemo {'finished' if ok else 'FAILED'}: last step {last_step}/{args.steps}, agent exit codes {codes}; {kept}")
        return 0 if ok else 1
    finally:
        for n in nodes.values():
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
                n.proc.wait(10)
            n.fh.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
