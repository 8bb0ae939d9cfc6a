"""The LSP editor methods on the wire, with the raw test client: every message the server sends is
checked against spec/metaModel.json (tests/rpcclient.py), and the spec lists what is answered.

The server's `inference/infill` is the fake of tests/lsp_helpers.py (no model)."""

from __future__ import annotations

import sys

import metamodel
import pytest
from lsp_helpers import FAKE_SERVER, events, fake_server
from rpcclient import RpcClient, RpcError

URI = "file:///w/a.py"


@pytest.fixture
def client(tmp_path):
    log = tmp_path / "infill.jsonl"
    _, env = fake_server(log, delay=0.0)
    c = RpcClient.spawn("-c", FAKE_SERVER, env=env, executable=sys.executable)
    c.log = log
    try:
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()


def test_the_initialize_result_lists_every_method_the_spec_has(client):
    result = client.initialize(
        {
            "locale": "fr",
            "rootPath": "/w",
            "rootUri": "file:///w",
            "workspaceFolders": [{"uri": "file:///w", "name": "w"}],
            "trace": "off",
            "workDoneToken": "t",
            "initializationOptions": {"logLevel": "warning", "completion": {"maxTokens": 8}},
        }
    )
    caps = result["capabilities"]
    spec = metamodel.model().model
    assert sorted(caps["methods"]) == sorted(r["method"] for r in spec["requests"])
    assert {"textDocument/completion", "textDocument/inlineCompletion"} <= set(caps["methods"])
    assert caps["textDocumentSync"] == {"openClose": True, "change": 2, "save": {"includeText": False}}
    assert caps["executeCommandProvider"] == {"commands": ["kinfer.accepted", "kinfer.stats"]}
    assert caps["completionProvider"] == {"resolveProvider": False}
    assert caps["inlineCompletionProvider"] == {}
    assert caps["cancellation"] is True and "llama" in caps["backends"]  # kinfer's own, as before
    notifications = {n["method"] for n in spec["notifications"]}
    assert {"textDocument/didOpen", "textDocument/didChange", "textDocument/didClose"} <= notifications


def test_unknown_initialize_members_are_still_refused(client):
    with pytest.raises(RpcError) as raised:
        client.call("initialize", {"processId": None, "rootUrl": "file:///w"})
    assert raised.value.code == -32602 and "rootUrl" in raised.value.message


def test_completions_on_the_wire(client):
    client.initialize()
    client.notify(
        "textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": "ab\n"}}
    )
    client.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": URI, "version": 2},
            "contentChanges": [
                {"range": {"start": {"line": 0, "character": 2}, "end": {"line": 0, "character": 2}}, "text": "c"}
            ],
        },
    )
    result = client.call(
        "textDocument/completion", {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 3}}
    )
    assert result["items"][0]["textEdit"]["newText"] == "abc_fake(3,1)"
    result = client.call(
        "textDocument/inlineCompletion",
        {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 3}, "context": {"triggerKind": 2}},
    )
    assert result["items"][0]["insertText"] == "_fake(3,1)"
    assert [e["event"] for e in events(client.log)] == ["start", "done", "start", "done"]
    # a document never opened, a closed one: -32602
    with pytest.raises(RpcError) as raised:
        client.call(
            "textDocument/completion",
            {"textDocument": {"uri": "file:///w/b.py"}, "position": {"line": 0, "character": 0}},
        )
    assert raised.value.code == -32602
    client.notify("textDocument/didClose", {"textDocument": {"uri": URI}})
    with pytest.raises(RpcError) as raised:
        client.call("textDocument/completion", {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 0}})
    assert raised.value.code == -32602


def test_accepted_items_and_stats_on_the_wire(client):
    client.initialize({"initializationOptions": {"completion": {"n": 2, "speculate": "never"}}})
    client.notify(
        "textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": "ab\n"}}
    )
    client.notify("textDocument/didSave", {"textDocument": {"uri": URI}, "text": "ab\n"})
    params = {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 2}}
    result = client.call("textDocument/completion", {**params, "context": {"triggerKind": 1}})
    (item,) = result["items"]  # the fake answers the same text for both: one item
    assert item["command"]["command"] == "kinfer.accepted" and item["data"]["usage"]
    inline = client.call(
        "textDocument/inlineCompletion",
        {
            **params,
            "context": {
                "triggerKind": 0,
                "selectedCompletionInfo": {
                    "range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 2}},
                    "text": "abc",
                },
            },
        },
    )
    assert inline["items"][0]["insertText"] == "abc_fake(3,1)"
    command = item["command"]
    assert (
        client.call("workspace/executeCommand", {"command": command["command"], "arguments": command["arguments"]})
        is None
    )
    stats = client.call("workspace/executeCommand", {"command": "kinfer.stats", "arguments": [{"uri": URI}]})
    assert stats["documents"][URI] == {"answered": 2, "offered": 2, "accepted": 1, "acceptedChars": 10, "speculated": 0}
    with pytest.raises(RpcError) as raised:
        client.call("workspace/executeCommand", {"command": "kinfer.nope"})
    assert raised.value.code == -32602
