"""Every log line is one write to its stream (contract/log.py).

The agent's own lines and its workers' tee'd lines (``[default0]:...``, one write each from torch's tail
threads) share the agent's stderr. A line written in two calls (structlog's ``PrintLogger``: ``print`` writes
the text, then ``"\\n"``) let a tee'd line land between them: ``{agent event}[default0]:{worker event}`` and a
lone newline, two JSON events no collector can parse (seen in CI at b94008d: a worker's
``checkpoint_committed`` missing from node b's log of tests/e2e/test_metrics_agent.py, its bytes exported)."""

from __future__ import annotations

import io
import json
import sys
import threading

from trainguard.contract.log import configure, get_logger


class Calls(io.StringIO):
    """A stream that records each ``write`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_one_event_is_one_write_call():
    stream = Calls()
    configure("json", stream=stream)
    get_logger("trainguard.test").info("one_event", n=1)
    [call] = stream.calls
    assert call.endswith("\n") and call.count("\n") == 1, stream.calls
    assert json.loads(call)["event"] == "one_event"


def test_lines_of_another_writer_never_land_inside_a_log_line(tmp_path):
    """A tee thread writing whole lines to the same stream while the agent logs: every line parses."""
    path = tmp_path / "agent.log"
    # sys.stderr as PYTHONUNBUFFERED=1 makes it (the systemd unit, the Docker image and the tests set it):
    # every write call goes to the file at once, and lets another thread run
    with io.TextIOWrapper(io.FileIO(path, "w"), line_buffering=True, write_through=True) as stream:
        configure("json", stream=stream)
        log = get_logger("trainguard.test")
        n = 3000
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
        try:
            def tee() -> None:
                for i in range(n):
                    stream.write("[default0]:" + json.dumps({"event": "worker_line", "i": i}) + "\n")

            t = threading.Thread(target=tee)
            t.start()
            for i in range(n):
                log.info("agent_line", i=i)
            t.join()
        finally:
            sys.setswitchinterval(old)
    bad, seen = [], {"agent_line": 0, "worker_line": 0}
    for line in path.read_text().splitlines():
        text = line.split("]:", 1)[-1] if line.startswith("[default") else line
        try:
            seen[json.loads(text)["event"]] += 1
        except ValueError:
            bad.append(line)
    assert not bad, f"{len(bad)} lines do not parse, e.g. {bad[:2]}"
    assert seen == {"agent_line": n, "worker_line": n}
