"""kinfer_rpc.protocol.lsp in-process, round two: the ring of chunks (the repository as context)
and its warming in idle time, the requests' trigger kinds and selected completion, `n`
alternatives, the early stops (nIndent, tMaxPromptMs, tMaxPredictMs), the acceptance command and
the completion computed ahead of it. Over fake `inference/infill`s (no model, no process)."""

from __future__ import annotations

import anyio
import pytest
from lsp_helpers import FakeInfill, before, change, make_editor, open_doc, pos, run

from kinfer_rpc import errors
from kinfer_rpc.protocol import lsp
from kinfer_rpc.protocol.lsp import parse_settings
from kinfer_rpc.protocol.ring import Ring, similarity
from kinfer_rpc.protocol.text import Text

GEOMETRY = "import math\n\n\ndef circle_area(radius):\n    return math.pi * radius**2\n"
MAIN = "import geometry\n\nprint(geometry.)\n"


def ask(editor, method, line, character, uri, context=None):
    params = {"textDocument": {"uri": uri}, "position": pos(line, character)}
    if context is not None:
        params["context"] = context
    editor.accept(method, params)
    return params


def names(call):
    return [e["filename"] for e in call.get("extra") or []]


# -- the ring -------------------------------------------------------------------------------------
def test_chunks_of_other_files_go_as_extra_ahead_of_the_open_files():
    infill = FakeInfill(text="circle_area(2))")
    editor = make_editor(infill)

    async def main():
        await open_doc(editor, GEOMETRY, uri="file:///pkg/geometry.py")
        await open_doc(editor, "# notes\nabout\nthe\ncircle\n", uri="file:///pkg/notes.md", language="markdown")
        await open_doc(editor, MAIN, uri="file:///pkg/main.py")
        await editor.completion(None, **ask(editor, lsp.COMPLETION, 2, 15, "file:///pkg/main.py"))
        call = infill.calls[-1]
        # the other Python file's definition, not the document itself, not the markdown
        assert call["extra"] == [{"filename": "/pkg/geometry.py", "text": GEOMETRY}]
        # with openFiles the whole file goes as an open file, not twice
        editor.initialize({"completion": {"openFiles": True}})
        await editor.completion(None, **ask(editor, lsp.COMPLETION, 2, 15, "file:///pkg/main.py"))
        assert names(infill.calls[-1]) == ["/pkg/geometry.py"]
        # ring: false sends nothing
        editor.initialize({"completion": {"ring": False}})
        await editor.completion(None, **ask(editor, lsp.COMPLETION, 2, 15, "file:///pkg/main.py"))
        assert "extra" not in infill.calls[-1]

    run(main)


def test_edits_make_the_chunk_around_them_and_replace_their_older_self():
    infill = FakeInfill()
    editor = make_editor(infill)
    big = "".join(f"line_{i} = {i}\n" for i in range(300))

    async def main():
        editor.initialize({"completion": {"ring": {"chunks": 3, "chunkLines": 64}}})
        await open_doc(editor, big, uri="file:///pkg/big.py")
        await open_doc(editor, "x = 1\n", uri="file:///pkg/main.py")
        ring = editor.documents.ring
        assert len(ring) == 1  # the first 64 lines
        # typing on line 200, one keystroke after another: one chunk, the latest
        for n, ch in enumerate("abc"):
            await editor.did_change(
                textDocument={"uri": "file:///pkg/big.py"}, contentChanges=[change(200, n, 200, n, ch)]
            )
        await editor.documents.settled().wait()
        chunks = ring.extra("python", ())
        assert len(chunks) == 2
        assert "abcline_200 = 200\n" in chunks[-1][1] and chunks[-1][1].count("\n") == 64
        assert chunks[-1][1].startswith("line_160 = 160\n")  # on a grid of half chunks
        # far regions: new chunks, the oldest going past `chunks`
        for line in (100, 280):
            await editor.did_change(
                textDocument={"uri": "file:///pkg/big.py"}, contentChanges=[change(line, 0, line, 0, "#")]
            )
        await editor.documents.settled().wait()
        chunks = ring.extra("python", ())
        assert len(chunks) == 3 and not chunks[0][1].startswith("line_0 = 0")
        # a save takes the chunk around the last edit again (here: the same, nothing changes)
        version = ring.version
        await editor.did_save(textDocument={"uri": "file:///pkg/big.py"})
        await editor.documents.settled().wait()
        assert ring.version == version

    run(main)


def test_a_long_documents_own_chunks_go_when_far_from_the_cursor():
    infill = FakeInfill()
    editor = make_editor(infill)
    uri = "file:///pkg/big.py"
    big = "".join(f"line_{i} = {i}\n" for i in range(300))

    def lines(text):
        return int(text.split(" = ", 1)[0].removeprefix("line_")), text.count("\n")

    async def main():
        await open_doc(editor, big, uri=uri)
        await editor.completion(None, **ask(editor, lsp.COMPLETION, 250, 0, uri))
        # lines 0-63 (taken on open) and 96-159 (a chunk's length above the cursor): far; not
        # the chunk around the cursor, which the prompt's prefix and suffix have
        assert [lines(e["text"]) for e in infill.calls[-1]["extra"]] == [(0, 64), (96, 64)]
        await editor.completion(None, **ask(editor, lsp.COMPLETION, 10, 0, uri))
        # now the chunk taken around line 250 is far, and the one at the start near
        assert [lines(e["text"]) for e in infill.calls[-1]["extra"]] == [(192, 64), (96, 64)]

    run(main)


def test_the_ring_is_bounded_by_characters_and_ignores_tiny_chunks():
    ring = Ring(chunks=16, chunk_lines=4, chars=40)
    assert not ring.add("a.py", "python", "x\n")  # fewer than 3 lines worth having
    assert ring.add("a.py", "python", "one = 1\ntwo = 2\nsix = 6\n")
    assert ring.add("b.py", "python", "aaa = 1\nbbb = 2\nccc = 3\n")
    assert [n for n, _ in ring.extra("python", ())] == ["b.py"]  # 48 characters: the oldest went
    assert not ring.add("c.py", "python", "x = 1\n" * 20)  # over the bound alone
    assert similarity(frozenset("abc"), frozenset("abd")) == pytest.approx(2 / 3)
    t = Text("".join(f"{i}\n" for i in range(10)))
    ring = Ring(chunks=4, chunk_lines=4, chars=1000)
    assert ring.pick("t.py", "python", t, 9)
    assert ring.extra("python", ()) == [("t.py", "6\n7\n8\n9\n")]


def test_bad_ring_settings_name_their_field():
    for value, field in (
        ({"ring": {"chunks": -1}}, "completion.ring.chunks"),
        ({"ring": {"chunkLine": 3}}, "chunkLine"),
        ({"ring": 3}, "completion.ring"),
        ({"speculate": "sometimes"}, "completion.speculate"),
        ({"n": 0}, "completion.n"),
        ({"nIndent": 2}, "completion.nIndent"),
        ({"automatic": {"tMaxPredictMs": -5}}, "completion.automatic.tMaxPredictMs"),
        ({"invoked": []}, "completion.invoked"),
    ):
        with pytest.raises(errors.KinferError) as raised:
            parse_settings(value, "completion")
        assert raised.value.code == errors.INVALID_PARAMS and field in raised.value.message, value


# -- warming in idle time -------------------------------------------------------------------------
def test_idle_time_reads_the_chunks_into_the_pool_once_and_a_completion_stops_it():
    infill = FakeInfill(wait=True)
    editor = make_editor(infill)

    async def main():
        editor.initialize({"completion": {"ring": {"warmMs": 50}}})
        async with anyio.create_task_group() as tg:
            tg.start_soon(editor.background)
            await anyio.sleep(0.01)  # it runs
            await open_doc(editor, GEOMETRY, uri="file:///pkg/geometry.py")
            await open_doc(editor, MAIN, uri="file:///pkg/main.py")
            await editor.did_change(
                textDocument={"uri": "file:///pkg/main.py"}, contentChanges=[change(2, 15, 2, 15, "c")]
            )
            await infill.started.wait()
            (warm,) = infill.calls
            assert warm["prefix"] == "" and warm["suffix"] == "" and warm["options"]["maxTokens"] == 1
            assert warm["extra"] == [{"filename": "/pkg/geometry.py", "text": GEOMETRY}]
            # a completion arriving stops the warm at once
            infill.wait = False
            got = await editor.completion(None, **ask(editor, lsp.COMPLETION, 2, 16, "file:///pkg/main.py"))
            await anyio.sleep(0.05)
            assert got["items"] and infill.cancelled == 1
            # idle again, the same chunks: no second warm
            await anyio.sleep(0.3)
            assert len(infill.calls) == 2 and editor.warms == 0  # the one warm was stopped
            # new chunks (another file): warmed once more
            await open_doc(editor, "def square(x):\n    y = x * x\n    return y\n", uri="file:///pkg/sq.py")
            await editor.did_change(
                textDocument={"uri": "file:///pkg/main.py"}, contentChanges=[change(2, 16, 2, 16, "i")]
            )
            with anyio.fail_after(5):
                while len(infill.calls) < 3:
                    await anyio.sleep(0.02)
            assert names(infill.calls[-1]) == ["/pkg/geometry.py", "/pkg/sq.py"]
            tg.cancel_scope.cancel()

    run(main)


# -- trigger kinds, the selected completion --------------------------------------------------------
def test_trigger_kinds_choose_the_options():
    infill = FakeInfill(text="x")
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        editor.initialize({"completion": {"maxTokens": 40, "invoked": {"maxTokens": 200}}})
        await open_doc(editor, MAIN, uri=uri)
        for method, context, want in (
            (lsp.COMPLETION, None, {"stopAtLine": True, "maxTokens": 40}),
            (lsp.COMPLETION, {"triggerKind": 1}, {"stopAtLine": True, "maxTokens": 40}),
            (lsp.COMPLETION, {"triggerKind": 2, "triggerCharacter": "."}, {"stopAtLine": True, "maxTokens": 40}),
            (lsp.INLINE_COMPLETION, {"triggerKind": 1}, {"stopAtLine": True, "maxTokens": 40}),
            (lsp.INLINE_COMPLETION, {"triggerKind": 0}, {"stopAtLine": False, "maxTokens": 200}),
        ):
            handler = editor.completion if method == lsp.COMPLETION else editor.inline_completion
            await handler(None, **ask(editor, method, 2, 15, uri, context))
            sent = infill.calls[-1]["options"]
            assert {k: sent[k] for k in want} == want, (method, context)
            assert not set(sent) & set(lsp.KNOBS)  # the LSP layer's own: never sent to infill
        with pytest.raises(errors.KinferError):
            editor.accept(
                lsp.INLINE_COMPLETION, {**ask(editor, lsp.COMPLETION, 0, 0, uri), "context": {"triggerKind": "x"}}
            )

    run(main)


def test_the_selected_completion_is_taken_as_typed():
    infill = FakeInfill(text="(2))")
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        await open_doc(editor, "import geometry\n\nprint(geometry.ci)\n", uri=uri)
        context = {
            "triggerKind": 1,
            "selectedCompletionInfo": {"range": {"start": pos(2, 15), "end": pos(2, 17)}, "text": "circle_area"},
        }
        got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 2, 17, uri, context))
        assert before(infill.calls[-1]) == "import geometry\n\nprint(geometry.circle_area"
        assert infill.calls[-1]["suffix"] == ")\n"
        (item,) = got["items"]
        assert item["insertText"] == "circle_area(2))"
        assert item["range"] == {"start": pos(2, 15), "end": pos(2, 17)}

    run(main)


# -- n alternatives, early stops -------------------------------------------------------------------
class StreamingInfill(FakeInfill):
    """Streams `pieces` to the request's context (as inference/infill does), `delay` seconds apart,
    after `prompt` seconds; answers the text by seed when `by_seed` says."""

    def __init__(self, pieces=(), delay=0.0, prompt=0.0, by_seed=None):
        super().__init__(text="".join(pieces))
        self.pieces, self.delay, self.prompt, self.by_seed = list(pieces), delay, prompt, by_seed or {}
        self.running = self.most_at_once = 0

    async def __call__(self, ctx, /, **p):
        self.calls.append(p)
        seed = p["options"].get("seed")
        if seed in self.by_seed:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            await anyio.sleep(0.02)
            self.running -= 1
            return {"model": "fake-fim", "text": self.by_seed[seed], "usage": {"promptTokens": 9, "cachedTokens": 8}}
        try:
            await anyio.sleep(self.prompt)
            for piece in self.pieces:
                if ctx is not None:
                    await ctx.report_partial({"text": piece, "tokens": [1]})
                await anyio.sleep(self.delay)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        self.finished += 1
        return {"model": "fake-fim", "text": self.text, "usage": {"promptTokens": 40, "cachedTokens": 0}}


def test_n_alternatives_are_several_items():
    infill = StreamingInfill(["area(r)"], by_seed={1: "perimeter(r)", 2: "area(r)"})
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        editor.initialize({"completion": {"n": 3}})
        await open_doc(editor, "x = circle_", uri=uri)
        got = await editor.completion(None, **ask(editor, lsp.COMPLETION, 0, 11, uri))
        assert [i["textEdit"]["newText"] for i in got["items"]] == ["circle_area(r)", "circle_perimeter(r)"]
        assert [i["preselect"] for i in got["items"]] == [True, False]
        # the first greedy as set, the others with their own seeds and a temperature
        assert [(c["options"].get("seed"), c["options"]["temperature"]) for c in infill.calls] == [
            (None, 0),
            (1, lsp.ALT_TEMPERATURE),
            (2, lsp.ALT_TEMPERATURE),
        ]
        assert [u["cachedTokens"] for u in got["items"][0]["data"]["usage"]] == [0, 8, 8]
        assert infill.most_at_once == 2  # after the first, the others run together (the same passes)
        inline = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 0, 11, uri))
        assert [i["insertText"] for i in inline["items"]] == ["area(r)", "perimeter(r)"]

    run(main)


def test_n_indent_stops_at_a_line_less_indented_than_the_cursors():
    pieces = ["x = 1\n", "    y = 2\n", "  z = 3\n", "def other():\n"]
    infill = StreamingInfill(pieces, delay=0.01)
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        editor.initialize({"completion": {"stopAtLine": False}})
        await open_doc(editor, "def f():\n    ", uri=uri)
        got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 1, 4, uri))
        assert [i["insertText"] for i in got["items"]] == ["x = 1\n    y = 2"]
        assert infill.cancelled == 1  # stopped there, not run to its end
        editor.initialize({"completion": {"stopAtLine": False, "nIndent": False}})
        got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 1, 4, uri))
        assert [i["insertText"] for i in got["items"]] == ["".join(pieces)]

    run(main)


def test_time_budgets_stop_the_prompt_and_the_generation():
    uri = "file:///pkg/main.py"

    async def main():
        # tMaxPredictMs: past it, the completion ends after its last whole line
        infill = StreamingInfill(["a = 1\n", "b = 2\n", "c = 3\n", "d = 4\n"], delay=0.05)
        editor = make_editor(infill)
        editor.initialize({"completion": {"stopAtLine": False, "tMaxPredictMs": 80}})
        await open_doc(editor, "", uri=uri)
        got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 0, 0, uri))
        assert [i["insertText"] for i in got["items"]] == ["a = 1\nb = 2\nc = 3\n"]  # not d
        assert infill.cancelled == 1
        # tMaxPromptMs: no text by then, no answer (and the infill stopped)
        infill = StreamingInfill(["a = 1"], prompt=0.4)
        editor = make_editor(infill)
        editor.initialize({"completion": {"model": "coder", "tMaxPromptMs": 50}})
        await open_doc(editor, "", uri=uri)
        with anyio.fail_after(0.3):
            got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 0, 0, uri))
        assert got == {"items": []} and infill.cancelled == 1
        # ...but not while infill may be loading the model it chooses (no model named, none known)
        editor.initialize({"completion": {"tMaxPromptMs": 50}})
        got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 0, 0, uri))
        assert [i["insertText"] for i in got["items"]] == ["a = 1"]

    run(main)


# -- acceptance, the completion computed ahead ------------------------------------------------------
def test_an_accepted_item_is_counted_and_the_next_completion_is_served_from_the_one_computed_ahead():
    infill = FakeInfill(text="circle_area(")
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(editor.background)
            await anyio.sleep(0.01)  # it runs
            await open_doc(editor, "import geometry\n\nprint(geometry.)\n", uri=uri)
            got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 2, 15, uri))
            (item,) = got["items"]
            assert item["command"]["command"] == lsp.ACCEPTED
            # the client inserts it and runs the item's command
            await editor.did_change(textDocument={"uri": uri}, contentChanges=[change(2, 15, 2, 15, "circle_area(")])
            infill.text = "2.0)"
            await editor.execute_command(None, command=lsp.ACCEPTED, arguments=item["command"]["arguments"])
            with anyio.fail_after(5):
                while len(infill.calls) < 2:
                    await anyio.sleep(0.01)
            ahead = infill.calls[-1]
            assert before(ahead) == "import geometry\n\nprint(geometry.circle_area(" and ahead["suffix"] == ")\n"
            # the next request sees that document: answered from it, no new infill
            infill.text = "never asked"
            got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 2, 27, uri))
            assert [i["insertText"] for i in got["items"]] == ["2.0)"]
            assert len(infill.calls) == 2
            # another document state: computed afresh
            await editor.did_change(textDocument={"uri": uri}, contentChanges=[change(2, 27, 2, 27, "r")])
            got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 2, 28, uri))
            assert [i["insertText"] for i in got["items"]] == ["never asked"] and len(infill.calls) == 3
            # accepted, and asked again at once (before the background took the work up): the
            # request waits for the completion computed ahead
            (item,) = got["items"]
            await editor.did_change(textDocument={"uri": uri}, contentChanges=[change(2, 28, 2, 28, "never asked")])
            infill.text = " + 1"
            await editor.execute_command(None, command=lsp.ACCEPTED, arguments=item["command"]["arguments"])
            got = await editor.inline_completion(None, **ask(editor, lsp.INLINE_COMPLETION, 2, 39, uri))
            assert [i["insertText"] for i in got["items"]] == [" + 1"]
            assert len(infill.calls) == 4  # the one computed ahead, none for the request
            assert before(infill.calls[-1]).endswith("circle_area(rnever asked")
            stats = await editor.execute_command(None, command=lsp.STATS, arguments=[{"uri": uri}])
            assert stats["documents"][uri] == {
                "answered": 4,
                "offered": 4,
                "accepted": 2,
                "acceptedChars": len("circle_area(never asked"),
                "speculated": 2,
            }
            # an id nobody offered is ignored; an unknown command is refused
            assert await editor.execute_command(None, command=lsp.ACCEPTED, arguments=[{"uri": uri, "id": "x"}]) is None
            with pytest.raises(errors.KinferError):
                await editor.execute_command(None, command="rm -rf")
            tg.cancel_scope.cancel()

    run(main)


def test_speculate_always_computes_ahead_after_each_answer_and_never_not_even_on_acceptance():
    infill = FakeInfill(text="abc")
    editor = make_editor(infill)
    uri = "file:///pkg/main.py"

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(editor.background)
            await anyio.sleep(0.01)  # it runs
            editor.initialize({"completion": {"speculate": "always", "ring": False}})
            await open_doc(editor, "x = ", uri=uri)
            await editor.completion(None, **ask(editor, lsp.COMPLETION, 0, 4, uri))
            with anyio.fail_after(5):
                while len(infill.calls) < 2:
                    await anyio.sleep(0.01)
            assert before(infill.calls[-1]) == "x = abc"
            editor.initialize({"completion": {"speculate": "never", "ring": False}})
            got = await editor.completion(None, **ask(editor, lsp.COMPLETION, 0, 4, uri))
            await editor.execute_command(None, command=lsp.ACCEPTED, arguments=got["items"][0]["command"]["arguments"])
            await anyio.sleep(0.2)
            assert len(infill.calls) == 3
            tg.cancel_scope.cancel()

    run(main)


def test_stopping_the_editor_stops_its_background_work():
    infill = FakeInfill(wait=True)
    editor = make_editor(infill)

    async def main():
        editor.initialize({"completion": {"ring": {"warmMs": 20}}})
        async with anyio.create_task_group() as tg:
            tg.start_soon(editor.background)
            await open_doc(editor, GEOMETRY, uri="file:///pkg/geometry.py")
            await open_doc(editor, MAIN, uri="file:///pkg/main.py")
            await infill.started.wait()  # a warm runs
            editor.stop()
            await anyio.sleep(0.05)
            assert infill.cancelled == 1
            await open_doc(editor, "def cube(x):\n    y = x ** 3\n    return y\n", uri="file:///pkg/cube.py")
            await anyio.sleep(0.2)
            assert len(infill.calls) == 1  # nothing more
            tg.cancel_scope.cancel()

    run(main)
