"""Interop with a client nobody here wrote: pygls 2's generic JsonRPCClient drives `kinfer-rpc`.

pygls frames, numbers and matches messages itself. Methods it has no lsprotocol type for (all of
ours) are read with its default converter, which turns the objects in their params and results
into namedtuples (`result.serverInfo.name`); errors come back as pygls exceptions carrying the
JSON-RPC code and `data`.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from lsprotocol.types import CancelParams
from pygls.client import JsonRPCClient
from pygls.exceptions import JsonRpcMethodNotFound, JsonRpcRequestCancelled

KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
TIMEOUT = 120.0
EXIT_WAIT = 5.0
CHAT = [{"role": "user", "content": "Name a colour."}]


class KinferClient(JsonRPCClient):
    """pygls's JsonRPCClient, recording what the server sends besides responses."""

    def __init__(self):
        super().__init__()
        self.progress: dict = {}  # token -> [value, ...]
        self.progressed = asyncio.Event()
        self.exited = asyncio.Event()
        self.returncode = None

        @self.feature("$/progress")
        def on_progress(params):
            self.progress.setdefault(params.token, []).append(params.value)
            self.progressed.set()

        @self.feature("window/logMessage")
        def on_log(params):
            pass

    async def server_exit(self, server):
        self.returncode = server.returncode
        self.exited.set()

    def request(self, method: str, params=None, msg_id=None) -> asyncio.Future:
        """Send a request now; the future resolves to its result or raises its error."""
        return self.protocol.send_request_async(method, params, msg_id=msg_id)

    async def initialize(self) -> dict:
        result = await self.request(
            "initialize", {"processId": os.getpid(), "clientInfo": {"name": "pygls"}, "capabilities": {}}
        )
        self.protocol.notify("initialized", {})
        return result

    async def wait_exit(self, timeout: float = EXIT_WAIT) -> bool:
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except TimeoutError:
            return False
        return True


def session(body):
    """Start `kinfer-rpc` under pygls, run `body(client)`, and always leave no process behind."""

    async def main():
        client = KinferClient()
        env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
        await client.start_io(KINFER_RPC, env=env)
        # pygls pipes the server's stderr and never reads it: drain it so the server never blocks.
        stderr = client._server.stderr
        drain = asyncio.create_task(stderr.read())
        try:
            return await asyncio.wait_for(body(client), TIMEOUT)
        finally:
            if client._server.returncode is None:
                client._server.kill()
            await client.stop()
            await drain

    return asyncio.run(main())


def test_initialize_and_an_unknown_method():
    async def body(client):
        result = await client.initialize()
        assert result.serverInfo.name == "kinfer-rpc"
        caps = result.capabilities
        assert caps.partialResults is True and caps.cancellation is True
        assert {"inference/chat", "inference/generate", "shutdown"} <= set(caps.methods)
        with pytest.raises(JsonRpcMethodNotFound) as raised:
            await client.request("no/such/method", {})
        assert raised.value.code == -32601

    session(body)


@pytest.mark.model
def test_streamed_chat_arrives_as_progress_notifications():
    async def body(client):
        await client.initialize()
        result = await client.request(
            "inference/chat",
            {"messages": CHAT, "options": {"maxTokens": 8, "temperature": 0}, "partialResultToken": "chat-1"},
        )
        values = client.progress["chat-1"]
        assert values, "no $/progress for the partialResultToken"
        assert "".join(v.text for v in values) == result.text
        assert [t for v in values for t in v.tokens] == result.tokens
        assert 1 <= len(result.tokens) <= 8

    session(body)


@pytest.mark.model
def test_cancelled_generate_answers_request_cancelled_with_the_partial_result():
    async def body(client):
        await client.initialize()
        running = client.request(
            "inference/generate",
            {
                "prompt": "Once upon a time",
                "options": {"maxTokens": 2000, "temperature": 0, "ignoreEos": True},
                "partialResultToken": "gen-1",
            },
            msg_id="gen-1",
        )
        await asyncio.wait_for(client.progressed.wait(), 60)  # it is running
        client.protocol.notify("$/cancelRequest", CancelParams(id="gen-1"))  # what pygls' LSP client sends
        with pytest.raises(JsonRpcRequestCancelled) as raised:
            await running
        assert raised.value.code == -32800
        partial = raised.value.data
        streamed = [t for v in client.progress["gen-1"] for t in v.tokens]
        assert 1 <= len(partial["tokens"]) < 2000
        assert partial["tokens"][: len(streamed)] == streamed
        # The server is still there for the next request.
        tokens = await client.request("inference/tokenize", {"text": "hello"})
        assert tokens.tokens

    session(body)


def _exit_code_after(shutdown_first: bool):
    async def body(client):
        await client.initialize()
        if shutdown_first:
            assert await client.request("shutdown") is None
        client.protocol.notify("exit")
        on_exit = await client.wait_exit()
        if not on_exit:
            client.protocol.writer.close()  # what an editor does when it gives up on the server
            assert await client.wait_exit(), "the server did not exit even when its stdin closed"
        return client.returncode, on_exit

    code, on_exit = session(body)
    return code, on_exit


def test_shutdown_then_exit_exits_0():
    code, on_exit = _exit_code_after(shutdown_first=True)
    assert code == 0
    assert on_exit, "the server waited for stdin to close after exit"


def test_exit_without_shutdown_exits_1():
    code, on_exit = _exit_code_after(shutdown_first=False)
    assert code == 1
    assert on_exit, "the server waited for stdin to close after exit"
