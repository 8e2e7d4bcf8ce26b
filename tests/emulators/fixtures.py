"""pytest fixtures: one fresh emulator per test, closed (threads joined) at teardown.

Use from a ``conftest.py``: ``from tests.emulators.fixtures import aws_imds, gcp_metadata, azure_events``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import AwsImdsEmulator, AzureEventsEmulator, GcpMetadataEmulator


@pytest.fixture
def aws_imds() -> Iterator[AwsImdsEmulator]:
    with AwsImdsEmulator() as emu:
        yield emu


@pytest.fixture
def gcp_metadata() -> Iterator[GcpMetadataEmulator]:
    with GcpMetadataEmulator() as emu:
        yield emu


@pytest.fixture
def azure_events() -> Iterator[AzureEventsEmulator]:
    with AzureEventsEmulator() as emu:
        yield emu
