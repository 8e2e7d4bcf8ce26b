"""The on-call operator's day two (issue 43), with real agents: exit codes a wrapper can act on, a
failed emergency checkpoint that says why, an agent that does not linger, `trainguard drain --wait`,
and a wrong rendezvous endpoint."""

from __future__ import annotations

import os

import pytest

from tests.harness import REPO, Node, free_port, running, short_tmp, wait_until  # noqa: F401 - short_tmp: a fixture
from trainguard.agent import control
from trainguard.agent.exitcodes import ExitCode
from trainguard.contract.protocol import DrainRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TRAIN = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--global-batch", "8"]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
SMALL = ["--d-model", "32", "--layers", "1", "--max-bytes", "200000", "--global-batch", "8", "--micro-batch", "2",
         "--log-every", "1", "--step-sleep", "0.1", "--steps", "100000"]


def agent_line(node: Node, event: str) -> list[dict]:
    return [e for e in node.events(event) if str(e.get("component", "")).startswith("trainguard.agent")]


def test_storage_failing_then_a_drain_names_the_error_and_exits_work_lost(short_tmp):
    """Item 1: the checkpoint storage breaks under a running job (here its folder is replaced by a
    file: every write fails, as on a read-only mount, also for root); `trainguard drain` then says
    which storage error lost how many steps, and the agent exits 5 (work lost), not 0."""
    tmp = short_tmp
    ckpt = os.path.join(tmp, "ckpt")
    ep = f"127.0.0.1:{free_port()}"
    extra = ["--set", f"checkpoint.url=file://{ckpt}", "--set", "checkpoint.retry_deadline_s=2",
             "--set", "checkpoint.retry_attempts=2", "--set", "checkpoint.memory_interval_steps=0"]
    with running([Node("a", tmp, ep, nnodes="1", extra=extra, script=ELASTIC, script_args=SMALL)]) as (a,):
        wait_until(lambda: len(a.events("train_step")) >= 3, 120, "training")
        if os.path.exists(ckpt):  # created at the first save or epoch claim
            os.rename(ckpt, ckpt + ".moved")
        with open(ckpt, "w") as fh:
            fh.write("the checkpoint storage is gone\n")
        assert control.request(a.socket, DrainRequest(deadline_s=30, reason="test")).ok
        assert a.wait(90) == ExitCode.WORK_LOST, a.dump()
        [line] = agent_line(a, "checkpoint_not_saved")
        assert line["kind"] == "emergency" and line["lost_steps"] >= 1, line
        assert "Not a directory" in line["error"] or "File exists" in line["error"], line
        assert line["error"] in line["fix"] and "set checkpoint.url" not in line["fix"], line
        [bye] = agent_line(a, "agent_exit")
        assert bye["exit_code"] == 5 and bye["meaning"] == "work lost" and bye["outcome"] == "stopped", bye


def test_finished_drained_and_stopped_exit_apart(short_tmp):
    """Item 1: a wrapper tells a finished job (0), a drained node (3) and a stopped one (4) apart."""
    tmp = short_tmp
    runs = [("fin", ["--steps", "3", "--log-every", "1", "--global-batch", "8"], None, ExitCode.FINISHED),
            ("drn", TRAIN, "drain", ExitCode.DRAINED), ("stp", TRAIN, "sigint", ExitCode.STOPPED)]
    nodes = [Node(name, tmp, f"127.0.0.1:{free_port()}", nnodes="1", job=name, script_args=args)
             for name, args, _, _ in runs]
    with running(nodes):
        for node, (_, _, how, code) in zip(nodes, runs):
            if how is not None:
                wait_until(lambda n=node: n.events("train_step"), 120, f"{node.name} training")
            if how == "drain":
                assert control.request(node.socket, DrainRequest(deadline_s=30, reason="test")).ok
            elif how == "sigint":
                node.signal(2)
            assert node.wait(90) == code, node.dump()
            [bye] = agent_line(node, "agent_exit")
            assert bye["exit_code"] == int(code) and bye["meaning"] == code.label, bye


def test_agent_does_not_linger_after_agent_exit_and_its_port_is_taken_over(short_tmp):
    """Item 5: an agent scraped every 6 s used to wait up to 2 x 6 s (bounded at 30 s) after
    ``agent_exit`` for one more scrape, and a restart on its metrics port failed meanwhile. Now the wait
    is at most FINAL_SCRAPE_MAX_WAIT_S, announced, cut short by a second Ctrl-C, and the next agent
    retries the busy port until the old one let it go."""
    import signal
    import time
    import urllib.request

    from trainguard.metrics.agent import FINAL_SCRAPE_MAX_WAIT_S

    tmp = short_tmp
    port = free_port()
    fixed = ["--set", f"metrics.port={port}"]

    def scrape() -> None:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()

    a = Node("a", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="a", extra=fixed, script_args=TRAIN)
    nodes = [a]
    with running(nodes):
        wait_until(lambda: a.events("train_step"), 120, "a training")
        scrape()
        time.sleep(6)
        scrape()  # a periodic scraper, every 6 s
        a.signal(signal.SIGINT)
        wait_until(lambda: a.events("agent_exit"), 60, "a's agent_exit")
        t_exit = time.monotonic()
        b = Node("b", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="b", extra=fixed, script_args=TRAIN)
        nodes.append(b)
        assert a.wait(30) == ExitCode.STOPPED, a.dump()
        lingered = time.monotonic() - t_exit
        assert lingered < FINAL_SCRAPE_MAX_WAIT_S + 1.5, f"a lingered {lingered:.1f} s after agent_exit\n{a.dump(12)}"
        [waited] = a.events("metrics_final_scrape_wait")
        assert waited["max_s"] <= FINAL_SCRAPE_MAX_WAIT_S and "Ctrl-C" in waited["skip"], waited
        # b took the port over (retrying while a still held it), then a second Ctrl-C skips its wait
        wait_until(lambda: b.events("train_step"), 120, "b training on the same metrics port")
        scrape()
        time.sleep(3)
        scrape()
        b.signal(signal.SIGINT)
        wait_until(lambda: b.events("metrics_final_scrape_wait"), 60, "b waiting for a last scrape")
        t_skip = time.monotonic()
        b.signal(signal.SIGINT)
        assert b.wait(30) == ExitCode.STOPPED, b.dump()
        assert time.monotonic() - t_skip < 2.0, b.dump()


def test_drain_wait_follows_the_node_out_and_says_how_it_ended(short_tmp):
    """Item 9: `trainguard drain` says in words what it asked; `--wait` blocks until the emergency
    checkpoint is committed and the node has left, prints the outcome and exits 0 (5 when the
    checkpoint failed: tested with storage that breaks first)."""
    import subprocess
    import sys

    tmp = short_tmp
    ckpt = os.path.join(tmp, "ckpt")
    extra = ["--set", f"checkpoint.url=file://{ckpt}", "--set", "checkpoint.memory_interval_steps=0",
             "--set", "checkpoint.retry_deadline_s=2", "--set", "checkpoint.retry_attempts=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}

    def drain(node: Node) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "drain", "--wait", "--socket", node.socket,
                               "--deadline", "30s"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)

    ok = Node("ok", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="ok", extra=extra, script=ELASTIC, script_args=SMALL)
    bad = Node("bad", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="bad", script=ELASTIC, script_args=SMALL,
               extra=[*extra[:1], f"checkpoint.url=file://{ckpt}-bad", *extra[2:]])
    with running([ok, bad]):
        wait_until(lambda: len(ok.events("train_step")) >= 2 and len(bad.events("train_step")) >= 2, 120, "training")
        r = drain(ok)
        assert ok.proc.poll() is not None, "drain --wait returned while the agent still ran"
        assert r.returncode == 0, r.stdout + r.stderr
        [committed] = {e["step"] for e in ok.events("checkpoint_committed")
                       if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"}
        assert "drain of job ok on node ok requested" in r.stdout, r.stdout
        assert f"left the job: drained (agent exit code 3); emergency checkpoint of step {committed} committed" \
            in r.stdout, r.stdout
        assert '"op"' not in r.stdout and "Traceback" not in r.stderr
        assert ok.wait(10) == ExitCode.DRAINED

        if os.path.exists(ckpt + "-bad"):
            os.rename(ckpt + "-bad", ckpt + "-bad.moved")
        with open(ckpt + "-bad", "w") as fh:
            fh.write("the checkpoint storage is gone\n")
        r = drain(bad)
        assert r.returncode == ExitCode.WORK_LOST, r.stdout + r.stderr
        assert "work lost (agent exit code 5); the emergency checkpoint failed:" in r.stderr, r.stderr
        assert bad.wait(10) == ExitCode.WORK_LOST


def test_a_wrong_rendezvous_endpoint_ends_in_one_line_naming_the_key(short_tmp):
    """Item 4: nothing listens at the endpoint. The agent says every few seconds that it waits, `status`
    finds it (state starting, waiting for the store), and after rendezvous.join_timeout_s it ends with
    one line naming rendezvous.endpoint / TRAINGUARD_RENDEZVOUS_ENDPOINT and the fix: no torch
    traceback, exit 2."""
    import subprocess
    import sys
    import time

    tmp = short_tmp
    ep = f"127.0.0.1:{free_port()}"  # nobody listens here
    n = Node("a", tmp, ep, nnodes="1:2", extra=["--set", "rendezvous.is_host=false",
                                              "--set", "rendezvous.join_timeout_s=8"], script_args=TRAIN)
    t0 = time.monotonic()
    with running([n]):
        wait_until(lambda: os.path.exists(n.socket), 60, "the control socket of the starting agent")
        st = subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "status", "--socket", n.socket],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
        assert st.returncode == 0, st.stdout + st.stderr
        assert "starting" in st.stdout and f"the rendezvous store at {ep}" in st.stdout, st.stdout
        assert n.wait(60) == ExitCode.USAGE, n.dump()
        assert time.monotonic() - t0 < 40
        text = "\n".join(n.lines())
        assert n.events("rendezvous_endpoint_unreachable"), n.dump()
        last = [ln for ln in n.lines() if ln.startswith("trainguard: ")][-1]
        assert last.startswith(f"trainguard: cannot reach the rendezvous store at {ep}"), last
        assert "(rendezvous.endpoint / TRAINGUARD_RENDEZVOUS_ENDPOINT): check the host and port" in last, last
        assert "Traceback" not in text and "RendezvousConnectionError" not in text and "frame #" not in text, text


CLOSING_SIGNAL = "closing signal SIGTERM"
"""torch elastic's per-worker line (multiprocessing/api.py) whenever it ends a worker that still runs."""

CRASH_ONE_RANK = """\
import os, sys, time
if os.environ["LOCAL_RANK"] == "1":
    sys.exit(1)
time.sleep(120)
"""


@pytest.mark.parametrize("script, args, nproc", [(None, TRAIN, "1"), (ELASTIC, SMALL, "2")],
                         ids=["sigterm-drain", "api-drain"])
def test_a_drain_is_quiet_and_leaves_no_lock_file(short_tmp, script, args, nproc):
    """Cosmetic (issue 43): torch's ``Sending process ... closing signal SIGTERM`` came on every drain
    (a script without the worker API is ended with SIGTERM; with the API the first worker out makes
    elastic end its siblings), and every run left its ``<job>.sock.lock`` in the state folder. A
    drained agent now prints neither; a lock left by a dead agent goes at the next start, a live
    agent's stays."""
    import fcntl

    tmp = short_tmp
    state = os.path.join(tmp, "state-drn")
    os.makedirs(state, mode=0o700)
    stale, held = os.path.join(state, "gone-run.sock.lock"), os.path.join(state, "live-run.sock.lock")
    open(stale, "w").close()
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    extra = ["--nproc-per-node", nproc, "--set", f"checkpoint.url=file://{os.path.join(tmp, 'ckpt')}",
             "--set", "checkpoint.memory_interval_steps=0"]
    try:
        with running([Node("drn", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="drn", extra=extra,
                           script=script or os.path.join(REPO, "examples", "train_gpt.py"), script_args=args)]) as (a,):
            wait_until(lambda: len(a.events("train_step")) >= 2, 120, "training")
            assert not os.path.exists(stale) and os.path.exists(held)
            assert control.request(a.socket, DrainRequest(deadline_s=30, reason="test")).ok
            assert a.wait(90) == ExitCode.DRAINED, a.dump()
            assert not [ln for ln in a.lines() if CLOSING_SIGNAL in ln], a.dump()
            assert not [f for f in os.listdir(state) if f.endswith(".sock.lock") and f != "live-run.sock.lock"]
            assert os.path.exists(held)
    finally:
        os.close(fd)


def test_a_crash_keeps_torchs_closing_signal_line(short_tmp):
    """The line stays where it says something: a worker crashed and elastic ended its sibling."""
    tmp = short_tmp
    crash = os.path.join(tmp, "crash_one_rank.py")
    with open(crash, "w") as fh:
        fh.write(CRASH_ONE_RANK)
    extra = ["--nproc-per-node", "2", "--set", "workers.max_restarts=0"]
    with running([Node("crs", tmp, f"127.0.0.1:{free_port()}", nnodes="1", job="crs", extra=extra, script=crash)]) as (a,):
        assert a.wait(90) not in (ExitCode.FINISHED, ExitCode.DRAINED, ExitCode.STOPPED), a.dump()
        assert [ln for ln in a.lines() if CLOSING_SIGNAL in ln], a.dump()
        assert not [f for f in os.listdir(a.state_dir) if f.endswith(".sock.lock")]


@pytest.mark.parametrize("how", ["tty", "forced"])
def test_worker_lines_follow_the_agents_log_format(short_tmp, how):
    """Cosmetic (issue 43): on a terminal the agent's lines turned to console format while its workers'
    (trainguard's runtime, tee'd with the ``[default0]:`` prefix) stayed JSON, because a worker's stderr
    is a log file. The agent now passes the format it decided (RuntimeEnv.log_format): under a
    pseudo-terminal (``script``) with ``agent.log_format: auto``, and with ``console`` forced."""
    import re
    import signal
    import subprocess
    import sys

    from tests.harness import descendants

    tmp = short_tmp
    cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", "1", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "fmt",
           "--node-name", "a", "--state-dir", os.path.join(tmp, "state"), "--log-dir", os.path.join(tmp, "logs"),
           "--set", "metrics.port=0", "--set", "preemption.sources=signal", "--set", "checkpoint.memory_interval_steps=0",
           *(["--set", "agent.log_format=console"] if how == "forced" else []), ELASTIC, *SMALL, "--steps", "3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if how == "tty":
        cmd = ["script", "-q", "-e", "-c", subprocess.list2cmdline(cmd), "/dev/null"]
    out_path = os.path.join(tmp, "out.log")
    with open(out_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        rc = proc.wait(150)
    finally:
        if proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
    with open(out_path, errors="replace") as fh:
        lines = [ln.replace("\r", "") for ln in fh.read().splitlines()]
    text = "\n".join(lines[-60:])
    assert rc == 0, text
    setup = [ln for ln in lines if "worker_setup" in ln]
    assert setup and all(re.match(r"\[default0\]:\d{4}-\d\d-\d\dT\S+ \[info\s*\] worker_setup ", ln) for ln in setup), text
    assert [ln for ln in lines if re.search(r"\[info\s*\] agent_control ", ln)], text  # the agent: console too
    assert not [ln for ln in lines if ln.startswith("[default0]:{") and '"component": "trainguard.' in ln], text
