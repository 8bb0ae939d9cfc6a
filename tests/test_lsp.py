"""kinfer_rpc.protocol.lsp in-process: LSP positions (UTF-16), document changes, the completion
settings, and completion requests over a fake `inference/infill` (no model, no process)."""

from __future__ import annotations

import json
import re
import threading
import tomllib
from pathlib import Path

import anyio
import pytest
from lsp_helpers import URI, FakeInfill, before, change, make_editor, open_doc, pos, run

from kinfer_rpc import errors
from kinfer_rpc.protocol import documents as lsp_documents
from kinfer_rpc.protocol import lsp
from kinfer_rpc.protocol.documents import apply_edits, parse_edits
from kinfer_rpc.protocol.lsp import parse_settings, settings_in
from kinfer_rpc.protocol.text import Text, utf16_len


# -- positions ----------------------------------------------------------------------------------
def test_utf16_lengths():
    assert utf16_len("abc") == 3
    assert utf16_len("é") == 1  # U+00E9: one unit
    assert utf16_len("😀") == 2  # U+1F600: a surrogate pair
    assert utf16_len("a😀b𝄞") == 6


def offset_at(text, line, character):
    return Text(text).locate(line, character)[0]


def apply_change(text, change):
    t = Text(text)
    apply_edits(t, parse_edits([change]))
    return str(t)


def test_offsets_count_utf16_units_and_every_line_ending():
    text = "a😀b\r\nsecond\rthird\nlast"
    assert offset_at(text, 0, 0) == 0
    assert offset_at(text, 0, 1) == 1  # before the emoji
    assert offset_at(text, 0, 3) == 2  # after it (two units)
    assert offset_at(text, 0, 4) == 3  # after b
    assert offset_at(text, 0, 99) == 3  # past the line's end: its end, before \r\n
    assert offset_at(text, 1, 0) == text.index("second")
    assert offset_at(text, 2, 2) == text.index("third") + 2
    assert offset_at(text, 3, 4) == len(text)
    assert offset_at(text, 9, 0) == len(text)  # past the last line: the end
    assert offset_at(text, 0, 2) == 2  # inside the surrogate pair: after the emoji


def test_incremental_changes_around_astral_characters():
    text = "x = '😀'\nprint(x)\n"
    # insert after the emoji: the emoji is at UTF-16 5..7
    text = apply_change(text, change(0, 7, 0, 7, "🎉"))
    assert text == "x = '😀🎉'\nprint(x)\n"
    # delete both emoji (5..9 in UTF-16 units)
    text = apply_change(text, change(0, 5, 0, 9, "ok"))
    assert text == "x = 'ok'\nprint(x)\n"
    # a change across lines, then a whole-text change
    text = apply_change(text, change(0, 8, 1, 5, "\nprint"))
    assert text == "x = 'ok'\nprint(x)\n"
    assert apply_change(text, {"text": "fresh"}) == "fresh"
    # rangeLength (deprecated) is accepted; an end before the start is the same range
    assert apply_change("abcdef", {**change(0, 4, 0, 1, "X"), "rangeLength": 3}) == "aXef"
    with pytest.raises(errors.KinferError):
        apply_change("abc", {"range": {"start": pos(0, 0)}, "text": ""})


# -- settings -----------------------------------------------------------------------------------
def test_settings_defaults_languages_and_their_options():
    s = parse_settings(None, "completion")
    assert s.options_for("python") == (True, {**lsp.KNOBS, **lsp.DEFAULT_OPTIONS})
    s = parse_settings(
        {
            "model": "coder",
            "loadOptions": {"contextLength": 2048},
            "maxTokens": 32,
            "stop": ["\n\n"],
            "languages": {"python": {"maxTokens": 128, "stopAtLine": False}, "markdown": {"enabled": False}},
        },
        "completion",
    )
    assert s.model == "coder" and s.load_options == {"contextLength": 2048}
    assert s.options_for("python") == (
        True,
        {**lsp.KNOBS, **lsp.DEFAULT_OPTIONS, "maxTokens": 128, "stop": ["\n\n"], "stopAtLine": False},
    )
    assert s.options_for("rust") == (True, {**lsp.KNOBS, **lsp.DEFAULT_OPTIONS, "maxTokens": 32, "stop": ["\n\n"]})
    # by trigger: an Automatic request gets one line in a tight time budget, an Invoked one lines on
    assert s.options_for("rust", "automatic")[1] == {
        **lsp.KNOBS,
        **lsp.DEFAULT_OPTIONS,
        "maxTokens": 32,
        "stop": ["\n\n"],
        "tMaxPromptMs": 500,
        "tMaxPredictMs": 250,
    }
    assert s.options_for("python", "invoked")[1]["stopAtLine"] is False
    assert s.options_for("markdown")[0] is False


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"maxTokens": "many"}, "completion.maxTokens"),
        ({"stopAtLine": 1}, "completion.stopAtLine"),
        ({"temprature": 0.2}, "completion: temprature"),
        ({"loadOptions": {"contextLenght": 10}}, "completion.loadOptions: contextLenght"),
        ({"loadOptions": 3}, "completion.loadOptions"),
        ({"languages": {"python": {"maxTokens": -1}}}, "completion.languages.python.maxTokens"),
        ({"languages": {"python": {"enabled": "yes"}}}, "completion.languages.python.enabled"),
        ({"model": 7}, "completion.model"),
        ([], "completion"),
    ],
)
def test_bad_settings_name_their_field(value, field):
    with pytest.raises(errors.KinferError) as raised:
        parse_settings(value, "completion")
    assert raised.value.code == errors.INVALID_PARAMS
    assert field in raised.value.message


def test_settings_are_found_under_kinfer_or_at_the_top():
    assert settings_in({"kinfer": {"completion": {"maxTokens": 1}}}) == {"maxTokens": 1}
    assert settings_in({"completion": {"maxTokens": 2}}) == {"maxTokens": 2}
    assert settings_in({"pylsp": {}}) is None
    assert settings_in(None) is None


def request(editor, method, line, character, uri=URI):
    params = {"textDocument": {"uri": uri}, "position": pos(line, character)}
    editor.accept(method, params)
    return params


def test_completion_replaces_the_word_before_the_cursor_with_it_and_the_continuation():
    infill = FakeInfill()
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "# 😀 note\ndef get\n\nprint(1)\n")
        p = request(editor, lsp.COMPLETION, 1, 7)
        result = await editor.completion(None, **p)
        call = infill.calls[0]
        # the cursor's line before it is the middle: typing on the line changes only that
        assert (call["prefix"], call["middle"]) == ("# 😀 note\n", "def get")
        assert call["suffix"] == "\n\nprint(1)\n"
        assert call["options"] == lsp.DEFAULT_OPTIONS
        assert "model" not in call  # infill chooses
        assert result["isIncomplete"] is True
        (item,) = result["items"]
        assert item["label"] == "get_name(x)"
        assert item["textEdit"] == {
            "range": {"start": pos(1, 4), "end": pos(1, 7)},
            "newText": "get_name(x)\n    return x",
        }
        # the same on a line with an astral character before the word: UTF-16 columns
        await editor.did_change(textDocument={"uri": URI, "version": 2}, contentChanges=[change(1, 0, 1, 0, "😀 ")])
        p = request(editor, lsp.COMPLETION, 1, 10)
        (item,) = (await editor.completion(None, **p))["items"]
        assert item["textEdit"]["range"] == {"start": pos(1, 7), "end": pos(1, 10)}
        p = request(editor, lsp.INLINE_COMPLETION, 1, 10)
        inline = await editor.inline_completion(None, **p)
        (command,) = [i.pop("command") for i in inline["items"]]
        assert command["command"] == "kinfer.accepted"
        assert inline == {
            "items": [{"insertText": "_name(x)\n    return x", "range": {"start": pos(1, 10), "end": pos(1, 10)}}]
        }

    run(main)


def test_a_line_completion_does_not_end_with_the_line_break():
    infill = FakeInfill(text=" = compute(x)\n")
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "value")
        (item,) = (await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 5)))["items"]
        assert item["textEdit"]["newText"] == "value = compute(x)"
        inline = await editor.inline_completion(None, **request(editor, lsp.INLINE_COMPLETION, 0, 5))
        assert inline["items"][0]["insertText"] == " = compute(x)"
        # without stopAtLine the text is the model's, line break and all
        editor.initialize({"completion": {"stopAtLine": False}})
        (item,) = (await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 5)))["items"]
        assert item["textEdit"]["newText"] == "value = compute(x)\n"
        # nothing but a line break: no item
        infill.text = "\n"
        editor.initialize({"completion": {}})
        assert (await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 5)))["items"] == []
        assert (await editor.inline_completion(None, **request(editor, lsp.INLINE_COMPLETION, 0, 5)))["items"] == []

    run(main)


def test_the_text_is_taken_when_the_request_arrives():
    infill = FakeInfill()
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "abc")
        p = request(editor, lsp.COMPLETION, 0, 3)
        await editor.did_change(textDocument={"uri": URI, "version": 2}, contentChanges=[{"text": "changed"}])
        await editor.completion(None, **p)
        assert before(infill.calls[0]) == "abc"

    run(main)


def test_a_newer_request_makes_the_running_one_answer_empty():
    infill = FakeInfill(wait=True)
    editor = make_editor(infill)
    results = {}

    async def main():
        await open_doc(editor, "def f():\n    ")
        async with anyio.create_task_group() as tg:

            async def ask(name, method, character):
                p = request(editor, method, 1, character)
                results[name] = await getattr(
                    editor, "completion" if method == lsp.COMPLETION else "inline_completion"
                )(None, **p)

            tg.start_soon(ask, "first", lsp.COMPLETION, 4)
            await infill.started.wait()
            assert editor.running(URI) == 1
            tg.start_soon(ask, "inline", lsp.INLINE_COMPLETION, 4)  # another method: not stale
            await anyio.sleep(0.01)
            tg.start_soon(ask, "second", lsp.COMPLETION, 4)
            await anyio.sleep(0.01)
            assert infill.cancelled == 1
            assert editor.running(URI) == 2  # the second completion and the inline one
            infill.release.set()
        assert results["first"] == {"isIncomplete": True, "items": []}
        assert len(results["second"]["items"]) == 1
        assert len(results["inline"]["items"]) == 1
        assert editor.running(URI) == 0

    run(main)


def test_a_request_made_stale_before_it_starts_never_calls_infill():
    infill = FakeInfill()
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "x")
        old = request(editor, lsp.COMPLETION, 0, 1)
        new = request(editor, lsp.COMPLETION, 0, 1)
        assert await editor.completion(None, **old) == {"isIncomplete": True, "items": []}
        assert len((await editor.completion(None, **new))["items"]) == 1
        assert len(infill.calls) == 1

    run(main)


def test_closing_a_document_stops_its_completion():
    infill = FakeInfill(wait=True)
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "x")
        out = []
        async with anyio.create_task_group() as tg:

            async def ask():
                p = request(editor, lsp.COMPLETION, 0, 1)
                out.append(await editor.completion(None, **p))

            tg.start_soon(ask)
            await infill.started.wait()
            await editor.did_close(textDocument={"uri": URI})
        assert out == [{"isIncomplete": True, "items": []}]
        assert infill.cancelled == 1
        with pytest.raises(errors.KinferError) as raised:
            request(editor, lsp.COMPLETION, 0, 1)
        assert raised.value.code == errors.INVALID_PARAMS

    run(main)


def test_settings_choose_the_model_its_load_and_each_languages_options():
    infill = FakeInfill()
    loads: list = []
    notes: list = []
    editor = make_editor(infill, loads, notes)

    async def main():
        editor.initialize({"completion": {"model": "coder", "loadOptions": {"slots": 2}, "maxTokens": 16}})
        await open_doc(editor, "x", language="python")
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 1))
        assert loads == [{"model": "coder", "backend": None, "options": {"slots": 2}}]
        assert infill.calls[-1]["model"] == "coder"
        assert infill.calls[-1]["options"]["maxTokens"] == 16
        await editor.did_change_configuration(
            settings={"kinfer": {"completion": {"temperature": 0.5, "languages": {"python": {"maxTokens": 8}}}}}
        )
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 1))
        assert infill.calls[-1]["options"] == {**lsp.DEFAULT_OPTIONS, "temperature": 0.5, "maxTokens": 8}
        assert "model" not in infill.calls[-1]
        # bad settings: reported in the client's log, the ones before kept
        await editor.did_change_configuration(settings={"completion": {"maxTokens": "lots"}})
        assert notes and notes[-1][0] == "window/logMessage" and notes[-1][1]["type"] == 1
        assert "maxTokens" in notes[-1][1]["message"]
        # settings that are not ours change nothing
        await editor.did_change_configuration(settings={"python": {"x": 1}})
        await editor.did_change_configuration(settings=None)
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 1))
        assert infill.calls[-1]["options"]["maxTokens"] == 8
        # a language turned off: no infill at all
        await editor.did_change_configuration(settings={"completion": {"languages": {"python": {"enabled": False}}}})
        n = len(infill.calls)
        assert (await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 1)))["items"] == []
        assert len(infill.calls) == n

    run(main)


def test_open_files_of_the_same_language_go_as_extra_context():
    infill = FakeInfill()
    editor = make_editor(infill)

    async def main():
        editor.initialize({"completion": {"openFiles": True}})
        await open_doc(editor, "import util\n", uri="file:///src/main%20app.py")
        await open_doc(editor, "def helper(): pass\n", uri="file:///src/util.py")
        await open_doc(editor, "# notes\n", uri="file:///src/notes.md", language="markdown")
        await editor.completion(None, **request(editor, lsp.COMPLETION, 1, 0, uri="file:///src/main%20app.py"))
        assert infill.calls[0]["extra"] == [{"filename": "/src/util.py", "text": "def helper(): pass\n"}]

    run(main)


def test_requests_for_documents_not_open_or_without_a_position_are_refused():
    editor = make_editor(FakeInfill())
    for params in (
        {"textDocument": {"uri": URI}, "position": pos(0, 0)},
        {"textDocument": {"uri": URI}},
        {"position": pos(0, 0)},
        {"textDocument": {"uri": URI}, "position": {"line": -1, "character": 0}},
    ):
        with pytest.raises(errors.KinferError) as raised:
            editor.accept(lsp.COMPLETION, params)
        assert raised.value.code == errors.INVALID_PARAMS


def test_the_settings_docs_editors_md_shows_are_accepted():
    """Every settings example in docs/editors.md (JSON, VS Code's settings, Helix's TOML) parses."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "editors.md").read_text()
    blocks = re.findall(r"```(json|toml)\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    for kind, body in blocks:
        if kind == "json":
            value = json.loads(body)
            init = value.get("glspc.server.initializationOptions", value)
        else:
            init = tomllib.loads(body)["language-server"]["kinfer"]["config"]
        settings = parse_settings(settings_in(init), "completion")
        assert settings.options["maxTokens"] in (48, 64)


# -- clamping, order, openFiles, bad notifications -------------------------------------------------
def test_answers_never_reach_past_the_document():
    infill = FakeInfill(text="_x")
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, "ab\nxy😀z")
        (item,) = (await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 99)))["items"]
        assert item["textEdit"]["range"] == {"start": pos(0, 0), "end": pos(0, 2)}  # past the line: its end
        assert before(infill.calls[-1]) == "ab"
        (item,) = (await editor.completion(None, **request(editor, lsp.COMPLETION, 7, 3)))["items"]
        assert item["textEdit"]["range"] == {"start": pos(1, 4), "end": pos(1, 5)}  # past the last line
        assert item["textEdit"]["newText"] == "z_x"
        inline = await editor.inline_completion(None, **request(editor, lsp.INLINE_COMPLETION, 1, 3))
        assert inline["items"][0]["range"] == {"start": pos(1, 4), "end": pos(1, 4)}  # inside the pair: after it

    run(main)


def test_a_request_sees_the_edits_before_it_even_when_they_run_on_the_worker():
    infill = FakeInfill()
    editor = make_editor(infill)
    many = [change(0, 0, 0, 0, "x") for _ in range(lsp_documents.LARGE_EDITS + 1)]

    gate = threading.Event()

    async def main():
        await open_doc(editor, "abc")
        editor.documents.jobs.run(gate.wait, large=True)  # the worker thread waits for the test
        await editor.did_change(textDocument={"uri": URI, "version": 2}, contentChanges=many)
        p = request(editor, lsp.COMPLETION, 0, 999)
        await editor.did_change(textDocument={"uri": URI, "version": 3}, contentChanges=[{"text": "later"}])
        assert not p[lsp.PINNED].view.ready
        gate.set()
        await editor.completion(None, **p)
        assert before(infill.calls[0]) == "x" * len(many) + "abc"
        await editor.documents.settled().wait()
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 99))
        assert before(infill.calls[1]) == "later"
        assert editor.documents.get(URI).version == 3

    run(main)


def test_open_files_take_the_most_relevant_within_the_limits(monkeypatch):
    infill = FakeInfill()
    editor = make_editor(infill)
    monkeypatch.setattr(lsp_documents, "OPEN_FILES", 3)

    async def main():
        editor.initialize({"completion": {"openFiles": True}})
        await open_doc(editor, "here\n", uri="file:///w/app/main.py")
        for uri in ["file:///w/app/near.py", "file:///w/far/a.py", "file:///w/far/b.py", "file:///w/app/sub/c.py"]:
            await open_doc(editor, f"# {uri}\n", uri=uri)
        await open_doc(editor, "# md\n", uri="file:///w/app/notes.md", language="markdown")
        await editor.did_change(textDocument={"uri": "file:///w/far/a.py"}, contentChanges=[change(0, 0, 0, 0, "!")])
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 0, uri="file:///w/app/main.py"))
        # the edited one first (sent last: infill keeps the extra context's end), then the nearest
        names = [e["filename"] for e in infill.calls[-1]["extra"]]
        assert names == ["/w/app/sub/c.py", "/w/app/near.py", "/w/far/a.py"]
        # the characters are bounded too: the most relevant file's end, nothing before it
        monkeypatch.setattr(lsp_documents, "OPEN_FILES_CHARS", 5)
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 0, uri="file:///w/app/main.py"))
        assert infill.calls[-1]["extra"] == [{"filename": "/w/far/a.py", "text": "a.py\n"}]

    run(main)


def test_bad_notifications_are_logged_in_one_line(caplog):
    infill = FakeInfill()
    editor = make_editor(infill)
    huge = "file:///" + "x" * 1_000_000

    async def main():
        await open_doc(editor, "abc")
        await editor.did_open("not", "an object")
        await editor.did_change(["array"])
        await editor.did_close([1])
        await editor.did_change_configuration([])
        await editor.did_change(textDocument={"uri": URI, "version": 2}, contentChanges="x")
        await editor.did_change(textDocument={"uri": URI, "version": 3}, contentChanges=[{"text": "ok"}, {"text": 1}])
        await editor.did_change(textDocument={"uri": URI}, contentChanges=[change(9, 0, 9, 0, "!")])
        await editor.did_change(textDocument={"uri": huge}, contentChanges=[])
        await editor.did_open(textDocument={"uri": 5})
        await editor.completion(None, **request(editor, lsp.COMPLETION, 0, 9))

    with caplog.at_level("WARNING"):
        run(main)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 9, lines
    assert all("\n" not in line and len(line) < 400 for line in lines), lines
    assert not any(r.exc_info for r in caplog.records)
    assert "params.contentChanges[1].text" in lines[5]
    assert "past the document's end" in lines[6]
    assert before(infill.calls[-1]) == "abc!"  # the batch with a bad change was dropped whole
