"""Fixtures for the protocol tests: real `kinfer-rpc` processes driven by tests/rpcclient.py.

Import them into a test module with `from protocol_fixtures import spawn, server, loaded`.
Every server a test started is ended at teardown and, unless the test is marked xfail (a known
bug may make the server misbehave), must have sent nothing but valid frames and messages that
match spec/metaModel.json.
"""

from __future__ import annotations

import pytest
from rpcclient import RpcClient


@pytest.fixture
def spawn(request):
    """A factory: `spawn(*args, env=None)` starts a server (not initialized) and returns its client."""
    clients: list[RpcClient] = []

    def make(*args: str, env: dict | None = None) -> RpcClient:
        client = RpcClient.spawn(*args, env=env)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close(timeout=3.0, check=False)
    if request.node.get_closest_marker("xfail") is None:
        for client in clients:
            client.assert_clean()


@pytest.fixture
def server(spawn) -> RpcClient:
    """An initialized server."""
    client = spawn()
    client.initialize()
    return client


@pytest.fixture
def loaded(server) -> RpcClient:
    """An initialized server with the embedded model loaded small (one slot, contextLength 256)."""
    server.load_model()
    return server
