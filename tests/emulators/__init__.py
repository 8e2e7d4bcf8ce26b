"""Local emulators of the cloud metadata APIs the preemption watchers talk to.

Each is a ``ThreadingHTTPServer`` on a free 127.0.0.1 port answering as the cloud documents
(headers, tokens, status codes, JSON shapes), able to issue a notice on command and to misbehave
(``garbage``, ``500``, ``hang``, ``slow``). Use them as context managers or through the pytest
fixtures in :mod:`tests.emulators.fixtures` (``aws_imds``, ``gcp_metadata``, ``azure_events``).
"""

from .aws import AwsImdsEmulator
from .azure import AzureEventsEmulator
from .base import EmulatorServer, RecordedRequest, Reply
from .gcp import GcpMetadataEmulator

__all__ = ["AwsImdsEmulator", "AzureEventsEmulator", "EmulatorServer", "GcpMetadataEmulator", "RecordedRequest",
           "Reply", "closed_port_url"]


def closed_port_url() -> str:
    """``http://127.0.0.1:<port>`` where nothing listens: connections are refused at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
