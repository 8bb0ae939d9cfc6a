"""kinfer-rpc as a language server, driven by a client we did not write: pygls 2's LanguageClient
with lsprotocol's types (the LSP 3.18 ones for inline completion).

Most tests run the real server with a fake `inference/infill` (tests/lsp_helpers.py): what
matters here is what the LSP layer sends to infill and what it answers, and the fake says both.
The test marked `model` completes with a real fill-in-the-middle model.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from lsp_helpers import events, fake_server
from lsprotocol import types as t
from pygls.exceptions import JsonRpcInvalidParams, JsonRpcRequestCancelled
from pygls_helpers import (
    KINFER_RPC,
    URI,
    Client,
    completion,
    did_change,
    did_open,
    edit,
    session,
    stock_initialize,
)


def inline(client, line, character, uri=URI):
    return client.text_document_inline_completion_async(
        t.InlineCompletionParams(
            text_document=t.TextDocumentIdentifier(uri=uri),
            position=t.Position(line, character),
            context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic),
        )
    )


def test_a_stock_initialize_gets_lsp_and_kinfer_capabilities(tmp_path):
    async def body(client, log, result):
        caps = result.capabilities
        assert caps.text_document_sync.change == t.TextDocumentSyncKind.Incremental
        assert caps.text_document_sync.open_close is True
        assert caps.completion_provider is not None and not caps.completion_provider.resolve_provider
        assert caps.inline_completion_provider is not None
        assert caps.position_encoding == t.PositionEncodingKind.Utf16
        assert result.server_info.name == "kinfer-rpc"

    session(tmp_path, body)


def test_incremental_edits_with_astral_characters_then_completions(tmp_path):
    async def body(client, log, result):
        did_open(client, "# app 🚀\ndef greet(name):\n    return\n\nprint(greet('x'))\n")
        # "    return" -> "    return '👋 ' + na" typed as three edits (UTF-16 columns)
        did_change(client, 2, edit(2, 10, 2, 10, " '👋 '"))
        did_change(client, 3, edit(2, 16, 2, 16, " + "))  # after the emoji: 10 + 6 units
        did_change(client, 4, edit(2, 19, 2, 19, "na"))
        got = await completion(client, 2, 21)
        start = next(e for e in events(log) if e["event"] == "start")
        assert start["prefix"] == "# app 🚀\ndef greet(name):\n    return '👋 ' + na"
        assert start["suffix"] == "\n\nprint(greet('x'))\n"
        assert start["options"] == {"maxTokens": 64, "stopAtLine": True, "temperature": 0}
        items = got.items if isinstance(got, t.CompletionList) else got
        (item,) = items
        continuation = f"_fake({len(start['prefix'])},{len(start['suffix'])})"
        assert item.text_edit.new_text == "na" + continuation
        assert item.label == "na" + continuation
        assert item.text_edit.range == t.Range(start=t.Position(2, 19), end=t.Position(2, 21))
        # inline completion: the continuation itself, at the cursor
        got = await inline(client, 2, 21)
        items = got.items if isinstance(got, t.InlineCompletionList) else got
        assert [i.insert_text for i in items] == [continuation]
        assert items[0].range == t.Range(start=t.Position(2, 21), end=t.Position(2, 21))
        # a whole-text change, then a deletion across the emoji
        did_change(client, 5, t.TextDocumentContentChangeWholeDocument(text="x = '🙂🙂'\n"))
        did_change(client, 6, edit(0, 5, 0, 7, ""))
        await completion(client, 0, 8)  # after the emoji (7) and the quote
        last = [e for e in events(log) if e["event"] == "start"][-1]
        assert last["prefix"] == "x = '🙂'"
        assert last["suffix"] == "\n"

    session(tmp_path, body)


def test_cancel_request_answers_request_cancelled(tmp_path):
    async def body(client, log, result):
        did_open(client, "slow\n")
        params = t.CompletionParams(text_document=t.TextDocumentIdentifier(uri=URI), position=t.Position(0, 4))
        running = client.protocol.send_request_async(t.TEXT_DOCUMENT_COMPLETION, params, msg_id="c-1")
        for _ in range(200):
            if any(e["event"] == "start" for e in events(log)):
                break
            await asyncio.sleep(0.02)
        client.protocol.notify(t.CANCEL_REQUEST, t.CancelParams(id="c-1"))
        with pytest.raises(JsonRpcRequestCancelled) as raised:
            await running
        assert raised.value.code == -32800
        await asyncio.sleep(0.2)
        assert [e["event"] for e in events(log)] == ["start", "cancelled"]

    session(tmp_path, body, delay=30.0)


def test_a_keystroke_storm_leaves_one_live_completion_per_document(tmp_path):
    """Two documents typed into at once, a completion request per keystroke, none awaited: each
    stale request answers empty, only the last of each document runs to the end."""
    word = "compute_the_answer"
    uris = ["file:///work/project/a.py", "file:///work/project/b.py"]

    async def body(client, log, result):
        for i, uri in enumerate(uris):
            did_open(client, f"# doc {i}\nx = \n", uri=uri)
        pending: dict[str, list] = {uri: [] for uri in uris}
        for n, ch in enumerate(word):
            for uri in uris:
                did_change(client, n + 2, edit(1, 4 + n, 1, 4 + n, ch), uri=uri)
                pending[uri].append(asyncio.ensure_future(completion(client, 1, 5 + n, uri=uri)))
            await asyncio.sleep(0.01)
        for uri in uris:
            answers = await asyncio.gather(*pending[uri])
            assert all(len(a.items) == 0 for a in answers[:-1]), "a stale request answered a completion"
            (item,) = answers[-1].items
            assert item.text_edit.new_text.startswith(word + "_fake(")
        ev = events(log)
        for i in range(len(uris)):
            mine = [e for e in ev if e["doc"] == f"# doc {i}"]
            done = [e for e in mine if e["event"] == "done"]
            assert len(done) == 1 and done[0]["prefix"] == f"# doc {i}\nx = {word}"
            started = sum(e["event"] == "start" for e in mine)
            assert sum(e["event"] == "cancelled" for e in mine) == started - 1
            # never two running for the document: the stale call ends (it is woken first) before
            # its successor starts
            live = peak = 0
            for e in mine:
                live += 1 if e["event"] == "start" else -1
                peak = max(peak, live)
            assert peak == 1

    session(tmp_path, body, delay=0.3)


def test_settings_from_initialization_options_and_configuration_changes(tmp_path):
    init = {"completion": {"model": "coder-fim", "loadOptions": {"slots": 2}, "maxTokens": 16, "openFiles": True}}

    async def body(client, log, result):
        did_open(client, "import helper\n")
        did_open(client, "def helper():\n    pass\n", uri="file:///work/project/helper.py")
        did_open(client, "# Notes\n", uri="file:///work/project/notes.md", language="markdown")
        await completion(client, 1, 0)
        ev = events(log)
        assert [e for e in ev if e["event"] == "load"][0]["model"] == "coder-fim"
        start = [e for e in ev if e["event"] == "start"][-1]
        assert start["model"] == "coder-fim" and start["options"]["maxTokens"] == 16
        assert start["extra"] == [{"filename": "/work/project/helper.py", "text": "def helper():\n    pass\n"}]
        client.workspace_did_change_configuration(
            t.DidChangeConfigurationParams(
                settings={"kinfer": {"completion": {"languages": {"python": {"maxTokens": 4, "temperature": 0.3}}}}}
            )
        )
        await completion(client, 1, 0)
        start = [e for e in events(log) if e["event"] == "start"][-1]
        assert start["options"] == {"maxTokens": 4, "stopAtLine": True, "temperature": 0.3}
        assert start["model"] is None and start["extra"] is None
        client.workspace_did_change_configuration(
            t.DidChangeConfigurationParams(settings={"kinfer": {"completion": {"maxTokens": -3}}})
        )
        for _ in range(100):
            if client.logs:
                break
            await asyncio.sleep(0.02)
        assert client.logs[-1].type == t.MessageType.Error and "maxTokens" in client.logs[-1].message

    session(tmp_path, body, init_options=init)


def test_bad_completion_settings_refuse_initialize(tmp_path):
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log)

    async def main():
        client = Client()
        await client.start_io(*cmd, env=env)
        drain = asyncio.create_task(client._server.stderr.read())
        try:
            with pytest.raises(JsonRpcInvalidParams) as raised:
                await client.initialize_async(stock_initialize({"completion": {"stopAtLine": "yes"}}))
            assert "initializationOptions.completion.stopAtLine" in str(raised.value)
            # nothing changed: a good initialize goes through
            result = await client.initialize_async(stock_initialize({"completion": {}}))
            assert result.capabilities.completion_provider is not None
        finally:
            client._server.kill()
            await client.stop()
            await drain

    asyncio.run(main())


@pytest.mark.model
def test_a_real_fim_model_completes_and_stale_requests_stop(tmp_path, fim):
    init = {
        "completion": {
            "model": fim,
            "loadOptions": {"contextLength": 2048, "slots": 2},
            "maxTokens": 8,
            "stopAtLine": False,
        }
    }
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}

    async def body(client, log, result):
        did_open(client, "def add(a, b):\n    return \n\nprint(add(1, 2))\n")
        got = await completion(client, 1, 11)  # loads the model
        assert isinstance(got, t.CompletionList) and got.is_incomplete
        for item in got.items:
            assert item.text_edit.range == t.Range(start=t.Position(1, 11), end=t.Position(1, 11))
            assert item.detail.startswith("kinfer (")
        got = await inline(client, 1, 11)
        assert isinstance(got, t.InlineCompletionList)
        # a keystroke storm: every request but the last answers empty, and nothing runs after
        pending = []
        for n, ch in enumerate("a + b"):
            did_change(client, n + 2, edit(1, 11 + n, 1, 11 + n, ch))
            pending.append(asyncio.ensure_future(completion(client, 1, 12 + n)))
            await asyncio.sleep(0.005)
        answers = await asyncio.gather(*pending)
        assert all(len(a.items) == 0 for a in answers[:-1])
        status = await client.protocol.send_request_async("model/status", {})
        assert all(m.slotsBusy == 0 for m in status.models if m.state == "ready")

    session(tmp_path, body, init_options=init, cmd=[KINFER_RPC], env=env)
