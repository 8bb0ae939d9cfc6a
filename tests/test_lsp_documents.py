"""Large documents and hostile editors through the real server (the fake `inference/infill` of
tests/lsp_helpers.py, which logs only sizes here): the event loop answers while a huge didChange
applies, one edit in a 50 MB document is quick, answers stay inside the document, `openFiles`
with more files than infill takes, and bad notifications cost one log line each, never a
traceback. The time limits are the targets with room for a loaded 2-core machine."""

from __future__ import annotations

import sys
import time

import pytest
from lsp_helpers import FAKE_SERVER, events, fake_server, typing_edits
from reliability_helpers import no_traceback
from rpcclient import RpcClient, send_together

URI = "file:///w/big.py"


@pytest.fixture
def client(tmp_path):
    log = tmp_path / "infill.jsonl"
    _, env = fake_server(log, sizes=True)
    c = RpcClient.spawn("-c", FAKE_SERVER, env=env, executable=sys.executable)
    c.log = log
    try:
        yield c
    finally:
        c.close(timeout=10, check=False)
    c.assert_clean()
    no_traceback(c)


def pos(line, character):
    return {"line": line, "character": character}


def at(line, character, uri=URI):
    return {"textDocument": {"uri": uri}, "position": pos(line, character)}


def open_doc(c, text, uri=URI, language="python"):
    c.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": language, "version": 1, "text": text}})


def change_then_ask(c, changes, line=0, version=2):
    """didChange, model/status and a completion in one write: when each answer came (seconds
    after the write) and the completion's answer."""
    status, completion = c.next_id(), c.next_id()
    messages = [
        {
            "jsonrpc": "2.0",
            "method": "textDocument/didChange",
            "params": {"textDocument": {"uri": URI, "version": version}, "contentChanges": changes},
        },
        {"jsonrpc": "2.0", "id": status, "method": "model/status", "params": {}},
        {"jsonrpc": "2.0", "id": completion, "method": "textDocument/completion", "params": at(line, 0)},
    ]
    t0 = time.monotonic()
    send_together(c, messages)
    answers = {rid: c.response(rid, timeout=60) for rid in (status, completion)}
    when = {rid: c.times[c.index_of(m)] - t0 for rid, m in answers.items()}
    assert "result" in answers[status] and "result" in answers[completion], answers
    return when[status], when[completion], answers[completion]["result"]


def test_twenty_thousand_edits_in_one_did_change_leave_the_server_answering(client):
    lines = 800_001
    client.initialize()
    open_doc(client, "abcde\n" * lines)
    client.call("textDocument/completion", at(0, 0), timeout=60)
    changes, delta = typing_edits(20_000, lines, 5)
    status, done, _ = change_then_ask(client, changes)
    assert status < 1.0, f"model/status took {status:.2f} s"
    assert status < done  # answered while the edits applied, not after
    assert done < 10.0, f"the edits took {done:.2f} s"
    last = [e for e in events(client.log) if e["event"] == "start"][-1]
    assert last["prefix"] + last["suffix"] == lines * 6 + delta


def test_one_edit_at_the_end_of_a_50_mb_document(client):
    lines = 1_250_000
    client.initialize()
    open_doc(client, "value = compute(alpha, beta) + 12345678\n" * lines)
    client.call("textDocument/completion", at(0, 0), timeout=60)
    status, done, _ = change_then_ask(
        client, [{"range": {"start": pos(lines - 1, 5), "end": pos(lines - 1, 5)}, "text": "x"}], lines - 1
    )
    assert status < 1.0, f"model/status took {status:.2f} s"
    assert done < 3.0, f"the edit and a completion took {done:.2f} s"
    last = [e for e in events(client.log) if e["event"] == "start"][-1]
    assert (last["prefix"], last["suffix"]) == (40 * (lines - 1), 41)


def test_answers_are_clamped_to_the_document(client):
    client.initialize()
    open_doc(client, "ab\nxyz")
    item = client.call("textDocument/completion", at(0, 99))["items"][0]
    assert item["textEdit"]["range"] == {"start": pos(0, 0), "end": pos(0, 2)}
    assert item["textEdit"]["newText"] == "ab_fake(2,4)"
    item = client.call("textDocument/completion", at(50, 7))["items"][0]
    assert item["textEdit"]["range"] == {"start": pos(1, 0), "end": pos(1, 3)}
    inline = client.call("textDocument/inlineCompletion", {**at(0, 1000), "context": {"triggerKind": 1}})
    assert inline["items"][0]["range"] == {"start": pos(0, 2), "end": pos(0, 2)}


def test_open_files_past_infills_limit_take_the_most_relevant(client):
    client.initialize({"processId": None, "initializationOptions": {"completion": {"openFiles": True}}})
    body = "def helper(x):\n    return x\n"
    for i in range(1100):
        open_doc(client, body, uri=f"file:///w/pkg{i % 5}/m{i}.py")
    client.notify(
        "textDocument/didChange",
        {"textDocument": {"uri": "file:///w/pkg3/m8.py", "version": 2}, "contentChanges": [{"text": "edited\n"}]},
    )
    result = client.call("textDocument/completion", at(0, 0, uri="file:///w/pkg0/m0.py"), timeout=30)
    assert result["items"]
    extra = [e for e in events(client.log) if e["event"] == "start"][-1]["extra"]
    assert len(extra) == 1024
    assert extra[-1] == "/w/pkg3/m8.py"  # edited: the most relevant, nearest the cursor in the prompt
    assert all(name.startswith("/w/pkg0/") for name in extra[-220:-1])  # then the same folder


def test_bad_notifications_cost_one_log_line_each(client):
    client.initialize()
    open_doc(client, "abc")
    huge = "file:///" + "x" * 20_000_000
    bad = [
        ("initialized", [1]),
        ("textDocument/didOpen", ["a", "b"]),
        ("textDocument/didOpen", {"textDocument": {"uri": 5}}),
        ("textDocument/didChange", [{"uri": URI}]),
        ("textDocument/didChange", {"textDocument": {"uri": URI}, "contentChanges": {"text": "x"}}),
        ("textDocument/didChange", {"textDocument": {"uri": URI}, "contentChanges": [{"text": "x", "range": 5}]}),
        (
            "textDocument/didChange",
            {
                "textDocument": {"uri": URI},
                "contentChanges": [{"range": {"start": pos(9, 0), "end": pos(9, 0)}, "text": "!"}],
            },
        ),
        ("textDocument/didChange", {"textDocument": {"uri": huge}, "contentChanges": [{"text": "y" * 1000}]}),
        ("textDocument/didClose", [1, 2]),
        ("workspace/didChangeConfiguration", ["settings"]),
    ]
    for method, params in bad:
        client.notify(method, params)
    result = client.call("textDocument/completion", at(0, 9))
    assert result["items"][0]["textEdit"]["newText"] == "_fake(4,0)"  # "abc!": only the clamped edit applied
    lines = [line for line in client.stderr_tail(200_000).splitlines() if line.startswith("kinfer-rpc WARNING")]
    assert len(lines) == len(bad), lines
    assert all(len(line) < 500 for line in lines), [line[:300] for line in lines if len(line) >= 500]
